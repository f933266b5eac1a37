"""Two-stage tree rollouts (seed §4.2): K roots, each stopped prefix continued B times, on the
paged KV cache so that Stage 2 forks each prefix instead of re-prefilling it.

Stage 1 samples K roots from the prompt. Root k stops at

    tau_causal = min(t_max, first t >= t_min whose token contains a newline)

or at its end-of-sequence token T_EOS, whichever comes first: both are stopping times of the
token filtration, so the stop is decided as the token arrives and no root decodes past it.
Stage 2 gives every pair B leaves according to ``early_eos_mode``:

- ``terminal_dup`` (stopped tree, arms 5-6): tau_k = min(tau_causal, T_EOS). A root that stopped
  at a newline is continued B times from its prefix (``causal_non_eos``); a root that ended in
  EOS is an absorbing terminal leaf, duplicated B times with zero-length continuations
  (``terminal_dup``). Every leaf has the sampling policy's exact marginal.
- ``root_resample`` (root restart, arms 7-8): an early-EOS root sets tau_k = 0 after the fact;
  branch 1 keeps the EOS sequence and the other branches are drawn afresh from the prompt
  (``tau_zero``). The event depends on the outcome, so sibling marginals are biased
  (P(EOS) = p on branch 1, p^2 on branch 2 for a policy with immediate-EOS probability p).
- ``midpoint`` (midpoint fallback, arms 9-10): an early-EOS root of at least
  ``midpoint_min_tokens`` tokens keeps its whole trajectory as branch 1 and splits the other
  branches at the interior newline boundary nearest its midpoint (``midpoint_fallback``, or
  ``early_eos_gt104`` when the root ran past 104 tokens before its EOS: the seed counts those
  apart); shorter early-EOS roots, or ones without an interior newline, restart at the root as
  in ``root_resample``.

Forking: a branch from prefix u shares the first |prompt| + |u| - 1 cached tokens of its root
(or of the prompt), then decodes u's last token, so Stage 2 runs no prefill at all and copies
at most one block per branch. ``reprefill=True`` runs the seed's way instead: every root
prefills the prompt and every branch prefills prompt + prefix; with the same generator both
ways sample the same tokens (the tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlvr_fast.engine.paged_kv import PagedSequences
from rlvr_fast.engine.sampler import FINISH_CAP, FINISH_EOS, SamplingParams, next_tokens
from rlvr_fast.ledger import EARLY_EOS_GT104_MIN_LENGTH

EARLY_EOS_MODES = ("terminal_dup", "root_resample", "midpoint")
FINISH_SPLIT = "split"


@dataclass
class TreePair:
    """One root and its B leaves. ``prefix_len`` is tau_k, the tokens all leaves share (0 for a
    pair restarted at the root); ``root_tokens`` is what Stage 1 sampled for this root."""

    category: str
    prefix_len: int
    root_tokens: list[int]
    leaves: list[list[int]]
    finish_reasons: list[str]
    continued: list[bool]

    @property
    def lengths(self) -> list[int]:
        return [len(leaf) for leaf in self.leaves]


@dataclass
class TreeRollout:
    """K pairs of B leaves (k-major) and what producing them cost: Stage-1 tokens sampled
    (trimmed at each root's stop), Stage-2 tokens sampled, prefill tokens run in each stage,
    decode rows run, block copies and the peak number of KV blocks in use."""

    pairs: list[TreePair]
    prompt_len: int
    stage1_generated: int
    stage2_generated: int
    stage1_prefill_tokens: int
    stage2_prefill_tokens: int
    decode_rows: int
    block_copies: int
    peak_kv_blocks: int
    texts: list[str] = field(default_factory=list)

    @property
    def leaves(self) -> list[list[int]]:
        return [leaf for pair in self.pairs for leaf in pair.leaves]

    @property
    def lengths(self) -> list[int]:
        return [len(leaf) for leaf in self.leaves]

    @property
    def prefix_lens(self) -> list[int]:
        """tau_k per pair."""
        return [pair.prefix_len for pair in self.pairs]

    @property
    def leaf_prefix_lens(self) -> list[int]:
        """The shared-prefix length of every leaf, in leaf order."""
        return [pair.prefix_len for pair in self.pairs for _ in pair.leaves]

    @property
    def prefill_tokens(self) -> int:
        return self.stage1_prefill_tokens + self.stage2_prefill_tokens


def sample_tree(policy, prompt_ids: Sequence[int], *, k: int = 4, b: int = 2, t_min: int = 96,
                t_max: int = 160, max_new_tokens: int = 512,
                early_eos_mode: str = "terminal_dup", temperature: float = 0.8,
                top_p: float = 0.9, generator: torch.Generator | None = None,
                reprefill: bool = False, block_size: int = 16,
                midpoint_min_tokens: int = 32) -> TreeRollout:
    """K x B tree rollout of one prompt from a ``Policy`` (see the module docstring)."""
    tokenizer = policy.tokenizer
    out = sample_tree_ids(
        policy.model, prompt_ids, eos_token_ids=tokenizer.eos_token_ids,
        newline_token_ids=tokenizer.newline_token_ids, k=k, b=b, t_min=t_min, t_max=t_max,
        max_new_tokens=max_new_tokens, early_eos_mode=early_eos_mode, temperature=temperature,
        top_p=top_p, generator=generator, reprefill=reprefill, block_size=block_size,
        midpoint_min_tokens=midpoint_min_tokens)
    out.texts = tokenizer.decode_batch(out.leaves)
    return out


@torch.inference_mode()
def sample_tree_ids(model, prompt_ids: Sequence[int], *, eos_token_ids: Sequence[int],
                    newline_token_ids: Sequence[int] | frozenset[int], k: int = 4, b: int = 2,
                    t_min: int = 96, t_max: int = 160, max_new_tokens: int = 512,
                    early_eos_mode: str = "terminal_dup", temperature: float = 0.8,
                    top_p: float = 0.9, generator: torch.Generator | None = None,
                    reprefill: bool = False, block_size: int = 16,
                    midpoint_min_tokens: int = 32) -> TreeRollout:
    """``sample_tree`` on a bare model, given the end-of-sequence and newline token ids."""
    _check_arguments(prompt_ids, k, b, t_min, t_max, max_new_tokens, early_eos_mode)
    prompt = list(prompt_ids)
    params = SamplingParams(max_new_tokens, temperature, top_p)
    eos, newline = frozenset(eos_token_ids), frozenset(newline_token_ids)
    blocks_per_sequence = -(-(len(prompt) + max_new_tokens) // block_size) + 1
    seqs = PagedSequences(model, (1 + k + k * b) * blocks_per_sequence, block_size=block_size)

    # Stage 1: K roots, each stopped at tau_causal or at its EOS.
    if reprefill:
        prompt_seq = None
        roots = [seqs.new() for _ in range(k)]
        logits = seqs.prefill(roots, [prompt] * k)
    else:
        prompt_seq = seqs.new()
        logits = seqs.prefill([prompt_seq], [prompt]).expand(k, -1)
        roots = [seqs.fork(prompt_seq) for _ in range(k)]

    def causal_stop(length: int, token: int) -> bool:
        return length >= t_max or (length >= t_min and token in newline)

    # Roots stay cached until Stage 2 has forked them (a midpoint split forks a finished one).
    root_tokens, root_reasons = _sample_rows(seqs, roots, logits, params, generator, eos,
                                             [max_new_tokens] * k, causal_stop,
                                             free_finished=False)
    stage1_prefill = seqs.prefill_tokens

    # Stage 2: plan every pair's branches, fork (or re-prefill) the ones that continue.
    plans = [plan_branches(tokens, reason, b, early_eos_mode, newline, midpoint_min_tokens)
             for tokens, reason in zip(root_tokens, root_reasons)]
    starts = [(pair, branch, prefix) for pair, plan in enumerate(plans)
              for branch, prefix in enumerate(plan.prefixes) if prefix is not None]
    if reprefill:
        children = [seqs.new() for _ in starts]
        logits = (seqs.prefill(children, [prompt + p for _, _, p in starts]) if starts else None)
    else:
        children = [seqs.fork(roots[pair] if prefix else prompt_seq, len(prompt) + len(prefix) - 1)
                    for pair, _, prefix in starts]
        last = [prefix[-1] if prefix else prompt[-1] for _, _, prefix in starts]
        logits = seqs.decode(children, last) if starts else None
    for seq in roots + ([prompt_seq] if prompt_seq is not None else []):
        seqs.free(seq)
    continuations, reasons = ([], [])
    if starts:
        budgets = [max_new_tokens - len(prefix) for _, _, prefix in starts]
        continuations, reasons = _sample_rows(seqs, children, logits, params, generator, eos,
                                              budgets, None, free_finished=True)
    for (pair, branch, prefix), tokens, reason in zip(starts, continuations, reasons):
        plans[pair].leaves[branch] = prefix + tokens
        plans[pair].finish_reasons[branch] = reason

    pairs = [TreePair(category=plan.category, prefix_len=plan.prefix_len, root_tokens=tokens,
                      leaves=plan.leaves, finish_reasons=plan.finish_reasons,
                      continued=[p is not None for p in plan.prefixes])
             for plan, tokens in zip(plans, root_tokens)]
    return TreeRollout(
        pairs=pairs, prompt_len=len(prompt),
        stage1_generated=sum(len(t) for t in root_tokens),
        stage2_generated=sum(len(t) for t in continuations),
        stage1_prefill_tokens=stage1_prefill,
        stage2_prefill_tokens=seqs.prefill_tokens - stage1_prefill,
        decode_rows=seqs.decode_rows, block_copies=seqs.block_copies,
        peak_kv_blocks=seqs.peak_blocks)


@dataclass
class BranchPlan:
    """Branch b continues from ``prefixes[b]`` (None: its leaf is already complete in
    ``leaves[b]``)."""

    category: str
    prefix_len: int
    prefixes: list[list[int] | None]
    leaves: list[list[int]]
    finish_reasons: list[str]


def plan_branches(root: list[int], reason: str, b: int, mode: str, newline: frozenset[int],
                  midpoint_min_tokens: int) -> BranchPlan:
    """What Stage 2 does with a root that stopped for ``reason`` ("split" at tau_causal or
    "eos"), under ``mode``: the rule table of the three samplers."""
    if reason == FINISH_SPLIT:
        return BranchPlan("causal_non_eos", len(root), [root] * b, [[] for _ in range(b)],
                         [""] * b)
    if mode == "terminal_dup":
        return BranchPlan("terminal_dup", len(root), [None] * b, [list(root) for _ in range(b)],
                         [reason] * b)
    split = (find_midpoint_boundary(root, newline)
             if mode == "midpoint" and len(root) >= midpoint_min_tokens else None)
    if split is None:
        return BranchPlan("tau_zero", 0, [None] + [[] for _ in range(b - 1)],
                         [list(root)] + [[] for _ in range(b - 1)], [reason] + [""] * (b - 1))
    # Long early-EOS roots are counted as their own midpoint category (seed §4.2).
    category = ("early_eos_gt104" if len(root) >= EARLY_EOS_GT104_MIN_LENGTH
                else "midpoint_fallback")
    return BranchPlan(category, split, [None] + [root[:split]] * (b - 1),
                     [list(root)] + [[] for _ in range(b - 1)], [reason] + [""] * (b - 1))


def find_midpoint_boundary(tokens: Sequence[int], newline: frozenset[int]) -> int | None:
    """The split point s (prefix = tokens[:s], 1 <= s < len(tokens)) right after a newline
    token, nearest to len(tokens) / 2 (the earlier one on a tie); None if there is none."""
    boundaries = [s for s in range(1, len(tokens)) if tokens[s - 1] in newline]
    if not boundaries:
        return None
    return min(boundaries, key=lambda s: (abs(2 * s - len(tokens)), s))


def _sample_rows(seqs: PagedSequences, rows: list[int], logits: torch.Tensor,
                 params: SamplingParams, generator, eos: frozenset[int], budgets: list[int],
                 stop, *, free_finished: bool) -> tuple[list[list[int]], list[str]]:
    """Sample every row until EOS, its token budget, or ``stop(length, token)``; a finished row
    leaves the batch at once (and frees its blocks, with ``free_finished``). ``logits``
    [len(rows), V] are those for each row's next token."""
    tokens: list[list[int]] = [[] for _ in rows]
    reasons = [""] * len(rows)
    active = list(range(len(rows)))
    while active:
        chosen = next_tokens(logits, params, generator).tolist()
        running = []
        for index, token in zip(active, chosen):
            tokens[index].append(token)
            length = len(tokens[index])
            if token in eos:
                reasons[index] = FINISH_EOS
            elif length >= budgets[index]:
                reasons[index] = FINISH_CAP
            elif stop is not None and stop(length, token):
                reasons[index] = FINISH_SPLIT
            else:
                running.append(index)
                continue
            if free_finished:
                seqs.free(rows[index])
        active = running
        if active:
            logits = seqs.decode([rows[i] for i in active], [tokens[i][-1] for i in active])
    return tokens, reasons


def _check_arguments(prompt_ids, k, b, t_min, t_max, max_new_tokens, mode) -> None:
    checks = [
        (len(prompt_ids) >= 1, "the prompt needs at least one token"),
        (k >= 1 and b >= 1 and k * b >= 2, f"need k >= 1, b >= 1 and k * b >= 2, got k={k}, b={b}"),
        (1 <= t_min <= t_max, f"need 1 <= t_min <= t_max, got t_min={t_min}, t_max={t_max}"),
        (t_max < max_new_tokens, f"t_max ({t_max}) must be below max_new_tokens ({max_new_tokens})"),
        (mode in EARLY_EOS_MODES,
         f"early_eos_mode must be one of {', '.join(EARLY_EOS_MODES)}, got {mode!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"sample_tree: {message}")
