"""Zero-gradient AdamW steps: eager ``p.grad = zeros_like(p); opt.step()`` vs ``zero_grad_adamw_``.

P = 50M float32 parameters in 5 tensors (the issue's measurement size), state after one real
step. ``steps`` consecutive zero-gradient steps per call: eager runs them one by one, the fused
kernel folds them into one pass over (p, m, v). Work is counted in parameter-steps.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.optim import zero_grad_adamw_

PARAMS, TENSORS = 50_000_000, 5


def make_optimizer():
    params = [torch.nn.Parameter(torch.randn(PARAMS // TENSORS)) for _ in range(TENSORS)]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in params:
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
def test_zero_grad_adamw(benchmark, role, steps):
    optimizer = make_optimizer()
    run = (lambda: eager_steps(optimizer, steps)) if role == "eager" else \
        (lambda: zero_grad_adamw_(optimizer, steps))
    mark(benchmark, f"zero_grad_adamw P=50M k={steps}", role, work=PARAMS * steps,
         unit="param-steps")
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
