"""Batched, KV-cached sampling with the study's temperature + top-p semantics.

Per step: p = softmax(logits / T); sort p descending; keep a token while the cumulative probability
*before* it is < top_p (the first token is always kept); renormalise; draw with
``torch.multinomial`` from the caller's ``torch.Generator``, so a run is reproducible.
``temperature == 0`` is greedy (argmax), used for evaluation.

Prompts are left-padded to one width and prefilled together. A row that emits an end-of-sequence
token leaves the batch at once: its cache rows are dropped, and every later decode step runs on the
remaining rows only. The returned counts are what the step ledger needs: unpadded and padded
prefill tokens, generated tokens (trimmed after the first EOS, EOS included), and the decode work
actually executed (rows x steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlvr_fast.engine.kv_cache import KVCache
from rlvr_fast.engine.paged_kv import PagedKVCache

FINISH_EOS = "eos"
FINISH_CAP = "cap"


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: cap on generated tokens per row (EOS included);
    temperature: softmax temperature, 0 for greedy; top_p: nucleus mass in (0, 1]."""

    max_new_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.9

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def greedy(cls, max_new_tokens: int = 2048) -> "SamplingParams":
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SampleOutput:
    """Per row (prompt order): generated ids (trimmed after the first EOS, EOS kept), their
    count, and why the row stopped ("eos" or "cap"); plus the batch's ledger counts."""

    tokens: list[list[int]]
    lengths: list[int]
    finish_reasons: list[str]
    prefill_tokens: int
    padded_prefill_tokens: int
    generated_tokens: int
    decode_tokens: int
    decode_steps: int
    peak_kv_blocks: int | None = None
    texts: list[str] = field(default_factory=list)


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (renormalised kept probabilities in descending order [B, V], their ids)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_before < top_p
    keep[:, 0] = True
    kept = sorted_probs * keep
    return kept / kept.sum(dim=-1, keepdim=True), sorted_ids


def next_tokens(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.is_greedy:
        return logits.argmax(dim=-1)
    probs, ids = top_p_probs(logits, params.temperature, params.top_p)
    choice = torch.multinomial(probs, 1, generator=generator)
    return ids.gather(1, choice).squeeze(1)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate(model, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
             eos_token_ids: Sequence[int], pad_token_id: int = 0,
             generator: torch.Generator | None = None, paged: bool = False,
             block_size: int = 16) -> SampleOutput:
    """Sample one completion per prompt (token-id lists) from ``model``.

    ``paged=True`` keeps the KV cache in ``block_size``-token blocks (``PagedKVCache``); the
    sampled tokens are the same as with the contiguous cache.
    """
    if not prompts:
        raise ValueError("generate: no prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    device = model.lm_head.weight.device
    ids, mask = left_pad(prompts, pad_token_id, device)
    capacity = ids.shape[1] + params.max_new_tokens
    dtype = model.lm_head.weight.dtype
    cache = (PagedKVCache(model.config, len(prompts), capacity, block_size=block_size,
                          dtype=dtype, device=device) if paged else
             KVCache.for_model(model.config, len(prompts), capacity, dtype=dtype, device=device))
    logits = model.prefill(ids, mask, cache)
    eos = set(eos_token_ids)
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons = [FINISH_CAP] * len(prompts)
    active = list(range(len(prompts)))
    decode_tokens = decode_steps = 0
    for step in range(params.max_new_tokens):
        chosen = next_tokens(logits, params, generator)
        # A CPU-GPU sync point per step: it is what lets finished rows leave the batch at once.
        keep = []
        for slot, (row, token) in enumerate(zip(active, chosen.tolist())):
            tokens[row].append(token)
            if token in eos:
                reasons[row] = FINISH_EOS
            else:
                keep.append(slot)
        if not keep or step == params.max_new_tokens - 1:
            break
        if len(keep) < len(active):
            slots = torch.tensor(keep, device=device)
            cache.keep_rows(slots)
            chosen = chosen.index_select(0, slots)
            active = [active[s] for s in keep]
        logits = model.decode(chosen, cache)
        decode_tokens += len(active)
        decode_steps += 1
    lengths = [len(t) for t in tokens]
    return SampleOutput(
        tokens=tokens, lengths=lengths, finish_reasons=reasons,
        prefill_tokens=sum(len(p) for p in prompts),
        padded_prefill_tokens=ids.numel(),
        generated_tokens=sum(lengths),
        decode_tokens=decode_tokens, decode_steps=decode_steps,
        peak_kv_blocks=cache.peak_blocks if paged else None)


def sample(policy, prompts: Sequence[str] | Sequence[Sequence[int]],
           params: SamplingParams | None = None, *,
           generator: torch.Generator | None = None) -> SampleOutput:
    """Sample from a ``Policy``; prompts are strings (tokenized here) or token-id lists.

    The output's ``texts`` are the decoded completions without special tokens.
    """
    params = params or SamplingParams()
    tokenizer = policy.tokenizer
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    out = generate(policy.model, prompt_ids, params, eos_token_ids=tokenizer.eos_token_ids,
                   pad_token_id=tokenizer.pad_token_id, generator=generator)
    out.texts = tokenizer.decode_batch(out.tokens)
    return out
