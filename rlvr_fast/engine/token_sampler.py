"""Next-token sampling with the study's temperature + top-p rule, on the device, one stream per
sequence.

Rule (seed §1): p = softmax(logits / T); sort p descending; keep a token while the cumulative
probability *before* it is < top_p (the first token is always kept); renormalise; draw.
``temperature == 0`` is greedy (argmax), used for evaluation.

The draw is an exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is distributed
as p (renormalising is not needed: it scales every p_i / E_i alike). E_i = -log u_i comes from a
counter-based hash of (the sequence's seed, the position being sampled, the rank i), so a
sequence's tokens depend only on its own seed and its own logits: not on which other sequences
share the batch, on the batch's order, or on how many draws came before. Everything stays on the
device (no host read, no generator state), which is what lets a CUDA graph replay the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# splitmix64 (Steele, Lea and Flood 2014): odd multipliers of the key and its finaliser, as
# signed 64-bit integers (torch's int64 arithmetic wraps modulo 2^64 on CPU and CUDA).
_SEED_MULTIPLIER = 0x9E3779B97F4A7C15 - 2**64
_POSITION_MULTIPLIER = 0xD1B54A32D192ED03 - 2**64
_RANK_MULTIPLIER = 0x8CB92BA72F3D8DD7 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64
_UNIFORM_BITS = 23  # (k + 0.5) / 2^23 needs 24 significant bits: exact in float32
_ranks: dict[tuple[int, torch.device], torch.Tensor] = {}


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: cap on generated tokens per sequence (EOS included);
    temperature: softmax temperature, 0 for greedy; top_p: nucleus mass in (0, 1]."""

    max_new_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.9

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def greedy(cls, max_new_tokens: int = 2048) -> "SamplingParams":
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic, logical shifts)."""
    x = (x ^ _logical_shift_right(x, 30)) * _MIX_1
    x = (x ^ _logical_shift_right(x, 27)) * _MIX_2
    return x ^ _logical_shift_right(x, 31)


def _rank_keys(width: int, device: torch.device) -> torch.Tensor:
    key = (width, device)
    if key not in _ranks:
        _ranks[key] = torch.arange(width, dtype=torch.int64, device=device) * _RANK_MULTIPLIER
    return _ranks[key]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """u [B, width] float32 in (0, 1): u[b, i] is a hash of (seeds[b], positions[b], i).

    seeds, positions [B] int64 on the device that gets the noise."""
    key = seeds * _SEED_MULTIPLIER + positions * _POSITION_MULTIPLIER
    bits = _logical_shift_right(
        _mix(key[:, None] + _rank_keys(width, seeds.device)), 64 - _UNIFORM_BITS
    )
    return (bits.float() + 0.5) * (1.0 / 2**_UNIFORM_BITS)


def top_p_probs(logits: torch.Tensor, temperature, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (kept probabilities in descending order, 0 where dropped [B, V], and the
    token id of each rank [B, V]). ``temperature`` and ``top_p`` are floats or 0-d tensors."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # mass_before of rank 0 is 0 < top_p, so the first token is always kept.
    return sorted_probs.masked_fill(mass_before >= top_p, 0.0), sorted_ids


def default_sampler_backend(device: torch.device) -> str:
    """ "cpp" on CPU (one C++ call per step, ``csrc/sampling.cpp``), else "torch" (the
    reference's device ops, which a CUDA graph captures)."""
    return "cpp" if device.type == "cpu" else "torch"


def sample_tokens(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature,
    top_p,
    *,
    greedy: bool,
    backend: str = "torch",
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device).

    ``seeds`` [B] int64 is each sequence's stream and ``positions`` [B] int64 the index in the
    sequence of the token being drawn; both ignored when greedy. ``backend`` "torch" (any
    device; temperature and top_p may be 0-d tensors) or "cpp" (CPU, float temperature and
    top_p; equal to "torch" up to float32 rounding)."""
    if greedy:
        return logits.argmax(dim=-1)
    if backend == "cpp":
        from rlvr_fast._C import sample_top_p_cpu  # built by setup.py

        return sample_top_p_cpu(logits.float(), seeds, positions, temperature, top_p)
    return sample_tokens_reference(logits, seeds, positions, temperature, top_p)


def sample_tokens_reference(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature, top_p
) -> torch.Tensor:
    """The sampled draw in torch ops, the definition the C++ version follows."""
    kept, ids = top_p_probs(logits, temperature, top_p)
    exponential = -torch.log(uniform_noise(seeds, positions, kept.shape[1]))
    choice = (kept / exponential).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1)


def derive_seed(base: int, index: int) -> int:
    """A 63-bit seed for stream ``index`` of a family rooted at ``base`` (splitmix64 of the
    pair), so that planners can give related sequences unrelated streams by structure (root k,
    branch (k, b)) rather than by the order they happen to be sampled in."""
    mask = 2**64 - 1
    x = (base * (_SEED_MULTIPLIER % 2**64) + (index + 1) * (_POSITION_MULTIPLIER % 2**64)) & mask
    x = ((x ^ (x >> 30)) * (_MIX_1 % 2**64)) & mask
    x = ((x ^ (x >> 27)) * (_MIX_2 % 2**64)) & mask
    return (x ^ (x >> 31)) >> 1
