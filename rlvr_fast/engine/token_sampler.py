"""Next-token sampling with the study's temperature + top-p rule, on the device, one stream per
sequence: ``SamplingParams`` and the one switch ``sample_tokens``. TRL's ``top_k``, ``min_p``
and ``repetition_penalty`` are options, off by default (off, every draw is what it was without
them); their order is transformers' (penalty, temperature, top-k, top-p, min-p: see
``rlvr_fast.kernels.top_p_sampling``).

The rule and the draw (an exponential race on noise hashed from the sequence's seed, the position
and the rank, so that a sequence's tokens never depend on the batch) are defined in
``rlvr_fast.kernels.top_p_sampling`` with its torch reference. ``temperature == 0`` is greedy
(argmax), used for evaluation. Everything stays on the device (no host read, no generator state),
which is what lets a CUDA graph replay the sampler. Backends: "triton" (CUDA and meta tensors:
three passes over the logits, no sort), "cpp" (CPU, one C++ call, ``csrc/sampling.cpp``), "torch"
(the reference, any device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlvr_fast.kernels.top_p_sampling import (
    MIX_1,
    MIX_2,
    POSITION_MULTIPLIER,
    SEED_MULTIPLIER,
    penalize_repeats,
    sample_tokens_reference,
    top_p_probs,
    uniform_noise,
)
from rlvr_fast.ops.backends import TRITON_DEVICES
from rlvr_fast.ops.top_p_sampling import sample_top_p

__all__ = [
    "SamplingParams",
    "default_sampler_backend",
    "derive_seed",
    "history_of",
    "penalize_repeats",
    "sample_tokens",
    "sample_tokens_reference",
    "top_p_probs",
    "uniform_noise",
]


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: cap on generated tokens per sequence (EOS included);
    temperature: softmax temperature, 0 for greedy; top_p: nucleus mass in (0, 1];
    top_k: sample among the k most likely tokens (0: all); min_p: drop tokens below min_p times
    the largest probability (0: none); repetition_penalty: divide (multiply, when negative) the
    logits of tokens already in the sequence, prompt included, by it (1: none; greedy too)."""

    max_new_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @classmethod
    def greedy(cls, max_new_tokens: int = 2048) -> "SamplingParams":
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes_repeats(self) -> bool:
        return self.repetition_penalty != 1


def default_sampler_backend(device: torch.device) -> str:
    """ "cpp" on CPU (one C++ call per step, ``csrc/sampling.cpp``), "triton" on CUDA (and on
    the meta device, which stands for it), else "torch"."""
    if device.type == "cpu":
        return "cpp"
    return "triton" if device.type in TRITON_DEVICES else "torch"


def sample_tokens(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature,
    top_p,
    *,
    greedy: bool,
    backend: str | None = None,
    top_k=0,
    min_p=0.0,
    repetition_penalty: float = 1.0,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device).

    ``seeds`` [B] int64 is each sequence's stream and ``positions`` [B] int64 the index in the
    sequence of the token being drawn; both ignored when greedy. ``top_k`` (0: off) and
    ``min_p`` (0: off) as ``SamplingParams`` reads them; ``repetition_penalty`` (1: off) needs
    ``history`` [B, L] int64, each row's tokens so far (``history_of``). ``backend`` "torch"
    (any device; temperature, top_p, top_k and min_p may be 0-d tensors), "triton" (CUDA, or CPU
    under TRITON_INTERPRET=1) or "cpp" (CPU, numbers; the penalty inside its one call); the last
    two equal "torch" up to float32 rounding. Default: "triton" on CUDA and meta tensors, else
    "torch"."""
    penalized = repetition_penalty != 1
    if penalized and history is None:
        raise ValueError(f"repetition_penalty={repetition_penalty} needs the rows' history")
    if backend is None:
        backend = "triton" if logits.device.type in TRITON_DEVICES else "torch"
    if backend == "cpp" and not greedy:
        from rlvr_fast._C import sample_top_p_cpu  # built by setup.py

        options = (top_k, min_p, repetition_penalty, history if penalized else None)
        return sample_top_p_cpu(logits.float(), seeds, positions, temperature, top_p, *options)
    if penalized:
        logits = penalize_repeats(logits, history, repetition_penalty)
    if greedy:
        return logits.argmax(dim=-1)
    if backend == "triton":
        return sample_top_p(logits, seeds, positions, temperature, top_p, top_k, min_p)
    return sample_tokens_reference(logits, seeds, positions, temperature, top_p, top_k, min_p)


def history_of(token_ids: list[list[int]], device: torch.device | None = None) -> torch.Tensor:
    """Rows' tokens so far as one [B, L] int64 tensor for the repetition penalty: each row
    padded with its own last token (a repeat, which the penalty counts once)."""
    width = max(len(ids) for ids in token_ids)
    rows = [ids + [ids[-1]] * (width - len(ids)) for ids in token_ids]
    return torch.tensor(rows, dtype=torch.long, device=device)


def derive_seed(base: int, index: int) -> int:
    """A 63-bit seed for stream ``index`` of a family rooted at ``base`` (splitmix64 of the
    pair), so that planners can give related sequences unrelated streams by structure (root k,
    branch (k, b)) rather than by the order they happen to be sampled in."""
    mask = 2**64 - 1
    x = (base * (SEED_MULTIPLIER % 2**64) + (index + 1) * (POSITION_MULTIPLIER % 2**64)) & mask
    x = ((x ^ (x >> 30)) * (MIX_1 % 2**64)) & mask
    x = ((x ^ (x >> 27)) * (MIX_2 % 2**64)) & mask
    return (x ^ (x >> 31)) >> 1
