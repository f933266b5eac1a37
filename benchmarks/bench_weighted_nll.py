"""Advantage-weighted token NLL, forward + backward: eager PyTorch vs ``weighted_token_nll``.

H = 1024 and V = 151,936 (Qwen3's vocabulary); T in {512, 2048} tokens on CPU (fp32); on CUDA
also bf16 and T in {4096, 16384}. Time is one forward + backward; peak memory is what the call
adds above its inputs (``benchmarks.harness.peak_memory_bytes``), gradients included; the
memory beyond dW is that peak less the [V, H] gradient both roles hold.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark, peak_memory_bytes
from rlvr_fast.kernels.weighted_nll import weighted_token_nll_reference
from rlvr_fast.ops import weighted_token_nll

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, VOCAB = 1024, 151_936
CASES = [(512, torch.float32), (2048, torch.float32)]
if DEVICE.type == "cuda":
    CASES += [(t, torch.bfloat16) for t in (2048, 4096, 16384)] + [(4096, torch.float32)]
IMPLEMENTATIONS = {"eager": weighted_token_nll_reference, "fast": weighted_token_nll}


def make_inputs(tokens: int, dtype: torch.dtype):
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, device=DEVICE, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=generator) / 32).to(dtype)
    targets = torch.randint(0, VOCAB, (tokens,), device=DEVICE, generator=generator)
    weights = torch.randn(tokens, device=DEVICE, generator=generator)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, weights


@pytest.mark.parametrize("role", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("tokens,dtype", CASES, ids=lambda c: str(c).removeprefix("torch."))
def test_weighted_nll(benchmark, role, tokens, dtype):
    hidden, weight, targets, weights = make_inputs(tokens, dtype)
    fn = IMPLEMENTATIONS[role]

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight, targets, weights).backward()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    # A first call pages in the kernels' code (resident, file-backed on the CPU), which is no
    # allocation of the op: warm on three tokens before the peak is read.
    small = [t[:3].detach().requires_grad_() for t in (hidden, weight)]
    fn(*small, targets[:3] % 3, weights[:3]).backward()
    peak = peak_memory_bytes(step, DEVICE)
    mark(
        benchmark,
        f"weighted_nll T={tokens} {str(dtype).removeprefix('torch.')}",
        role,
        work=tokens,
        unit="tokens",
    )
    benchmark.extra_info["peak_mib"] = peak / 2**20
    benchmark.pedantic(step, rounds=1 if DEVICE.type == "cpu" else 5, warmup_rounds=0)
