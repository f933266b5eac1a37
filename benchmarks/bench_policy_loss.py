"""TRL's GRPO policy loss with clipping and the KL term on, forward + backward: eager PyTorch
(fp32 [T, V] logits, log-softmax, entropy, TRL's formulas) vs ``fused_policy_loss``.

H = 512 and V = 151,936 (Qwen3's vocabulary), dapo with epsilon_high 0.28 and beta 0.04 ("kl"),
and the same with TRL's entropy bonus (entropy_coef 0.01) over its top-20% entropy tokens
("entropy": pass 2 then forms the entropy's gradient too), at temperature 0.7; T = 512 tokens on CPU (fp32), on CUDA also bf16 and T in {2048, 8192}. Time is
one forward + backward; peak memory is what the call adds above its inputs
(``benchmarks.harness.peak_memory_bytes``), gradients included, after one warm call on three
tokens (a first call pages in the kernels' code, which is no allocation of the op).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from benchmarks.harness import LiveBytes, mark, peak_memory_bytes
from rlvr_fast.kernels.policy_loss import token_stats_reference
from rlvr_fast.ops.policy_loss import PolicyLossSettings, fused_policy_loss, policy_objective

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, VOCAB, SEQUENCE, TEMPERATURE = 512, 151_936, 128, 0.7
KL = PolicyLossSettings(loss_type="dapo", epsilon_high=0.28, beta=0.04)
SETTINGS = {
    "kl": KL,
    "entropy": dataclasses.replace(KL, entropy_coef=0.01, top_entropy_quantile=0.2),
}
CASES = [(512, torch.float32)]
if DEVICE.type == "cuda":
    CASES += [(t, torch.bfloat16) for t in (2048, 8192)] + [(2048, torch.float32)]


def eager_policy_loss(hidden, weight, targets, old, advantages, lengths, ref, settings):
    logprobs, entropy = token_stats_reference(hidden, weight, targets, TEMPERATURE)
    return policy_objective(logprobs, old, advantages, lengths, settings, ref, entropy=entropy)[0]


def fused(hidden, weight, targets, old, advantages, lengths, ref, settings):
    return fused_policy_loss(
        hidden, weight, targets, old, advantages, lengths, settings,
        ref_logprobs=ref, temperature=TEMPERATURE,
    )[0]  # fmt: skip


IMPLEMENTATIONS = {"eager": eager_policy_loss, "fast": fused}


def make_inputs(tokens: int, dtype: torch.dtype):
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, device=DEVICE, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=generator) / 32).to(dtype)
    targets = torch.randint(0, VOCAB, (tokens,), device=DEVICE, generator=generator)
    old, ref = -12 + torch.randn(2, tokens, device=DEVICE, generator=generator)
    lengths = [SEQUENCE] * (tokens // SEQUENCE)
    advantages = torch.randn(len(lengths), device=DEVICE, generator=generator)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, old, advantages, lengths, ref


@pytest.mark.parametrize("role", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("terms", list(SETTINGS))
@pytest.mark.parametrize("tokens,dtype", CASES, ids=lambda c: str(c).removeprefix("torch."))
def test_policy_loss(benchmark, role, terms, tokens, dtype):
    hidden, weight, targets, old, advantages, lengths, ref = make_inputs(tokens, dtype)
    fn = functools.partial(IMPLEMENTATIONS[role], settings=SETTINGS[terms])

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight, targets, old, advantages, lengths, ref).backward()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    small = [t[:3].detach().requires_grad_() for t in (hidden, weight)]
    fn(*small, targets[:3] % 3, old[:3], advantages[:1], [3], ref[:3]).backward()
    peak = peak_memory_bytes(step, DEVICE)
    mark(
        benchmark,
        f"policy_loss {terms} T={tokens} {str(dtype).removeprefix('torch.')}",
        role,
        work=tokens,
        unit="tokens",
    )
    benchmark.extra_info["peak_mib"] = peak / 2**20
    benchmark.pedantic(step, rounds=1 if DEVICE.type == "cpu" else 5, warmup_rounds=0)


def bytes_beyond_head_gradient(role: str, terms: str, tokens: int) -> int:
    """Peak bytes one forward + backward allocates beyond dW (fp32 [V, H]), storage by storage
    (``LiveBytes``: no allocator or resident-set noise), fp32."""
    hidden, weight, targets, old, advantages, lengths, ref = make_inputs(tokens, torch.float32)
    fn = functools.partial(IMPLEMENTATIONS[role], settings=SETTINGS[terms])
    tracker = LiveBytes(ignore=[hidden, weight, targets, old, advantages, ref])
    with tracker:
        fn(hidden, weight, targets, old, advantages, lengths, ref).backward()
    return tracker.peak - VOCAB * HIDDEN * 4


if __name__ == "__main__":
    # python -m benchmarks.bench_policy_loss: memory beyond dW at T = 2,048 (the 1/20).
    for terms in SETTINGS:
        eager, fast = (bytes_beyond_head_gradient(r, terms, 2048) for r in IMPLEMENTATIONS)
        print(
            f"{terms}, T = 2048 fp32: beyond dW eager {eager / 2**20:,.1f} MiB, fused "
            f"{fast / 2**20:,.1f} MiB, {fast / eager:.3f} of eager"
        )
