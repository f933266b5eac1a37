"""Zero-gradient AdamW steps: eager ``p.grad = zeros_like(p); opt.step()`` vs ``zero_grad_adamw_``.

CPU: P = 10M and 50M float32 parameters in 5 tensors (the sizes the step was first measured at),
the C++ kernel, beside the memory floor measured in the same run: one in-place pass over p, m and v
(``mul_(1.0)``: each read and written once, the least any AdamW step can move).
CUDA (skipped without a GPU): P = 752M float32 parameters in 8 tensors (Qwen3-0.6B's size with
its embeddings), torch's default foreach AdamW vs the Triton kernel. State after one real step.
``steps`` consecutive zero-gradient steps per call: eager runs them one by one, the fused kernels
fold them into one pass over (p, m, v). Work is counted in parameter-steps, so the summary's
rate is per step. The fused call moves 24 bytes per float32 parameter (p, m, v read and
written once) whatever ``steps`` is; the summary prints that traffic as GB/s, to set against
the memory's peak (4.8 TB/s on an H200).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.ops.zero_grad_adamw import zero_grad_adamw_

CASES = [
    pytest.param("cpu", 10_000_000, 5, id="cpu-P=10M"),
    pytest.param("cpu", 50_000_000, 5, id="cpu-P=50M"),
    pytest.param(
        "cuda",
        752_000_000,
        8,
        id="cuda-P=752M",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]
BYTES_PER_PARAM = 24


def make_optimizer(device: str, params: int, tensors: int):
    generator = torch.Generator(device=device).manual_seed(0)
    weights = [
        torch.nn.Parameter(torch.randn(params // tensors, device=device, generator=generator))
        for _ in range(tensors)
    ]
    optimizer = torch.optim.AdamW(weights, lr=1e-5, weight_decay=0.01)
    for p in weights:
        p.grad = torch.randn(p.shape, device=device, generator=generator)
    optimizer.step()
    for p in weights:
        p.grad = None
    return optimizer


def eager_steps(optimizer, steps):
    for _ in range(steps):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("role", ["eager", "fast"])
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("device,params,tensors", CASES)
def test_zero_grad_adamw(benchmark, device, params, tensors, role, steps):
    optimizer = make_optimizer(device, params, tensors)

    def run():
        if role == "eager":
            eager_steps(optimizer, steps)
        else:
            zero_grad_adamw_(optimizer, steps)
        if device == "cuda":
            torch.cuda.synchronize()

    mark(
        benchmark,
        f"zero_grad_adamw {device} P={params // 1_000_000}M k={steps}",
        role,
        work=params * steps,
        unit="param-steps",
    )
    if role == "fast":
        benchmark.extra_info["bytes"] = BYTES_PER_PARAM * params
    benchmark.pedantic(run, rounds=3 if device == "cpu" else 5, warmup_rounds=1)


@pytest.mark.parametrize("device,params,tensors", CASES)
def test_memory_floor(benchmark, device, params, tensors):
    """Read and write p, m and v once: the floor a zero-gradient step is measured against."""
    optimizer = make_optimizer(device, params, tensors)
    arrays = [
        t
        for p in optimizer.param_groups[0]["params"]
        for t in (p.data, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
    ]

    def run():
        for array in arrays:
            array.mul_(1.0)
        if device == "cuda":
            torch.cuda.synchronize()

    benchmark.group = f"zero_grad_adamw {device} P={params // 1_000_000}M k=1"
    benchmark.extra_info["counts"] = dict(floor_bytes=BYTES_PER_PARAM * params)
    benchmark.pedantic(run, rounds=3 if device == "cpu" else 5, warmup_rounds=1)
