"""zero_grad_adamw_: bitwise equal to k rounds of {p.grad = zeros; AdamW.step()}."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rlvr_fast.data import synthetic_problems
from rlvr_fast.optim import zero_grad_adamw_
from rlvr_fast.policy import load_policy
from rlvr_fast.trainer import GRPOTrainer, TrainConfig

SIZES = (1, 7, 1000, 100_003)


def make_optimizer(dtypes, size, real_steps, weight_decay, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(size, generator=generator).to(dtype))
              for dtype in dtypes]
    groups = [{"params": params[:1]}]
    if len(params) > 1:
        groups.append({"params": params[1:], "lr": 3e-3, "weight_decay": 0.1, "eps": 1e-6})
    optimizer = torch.optim.AdamW(groups, lr=1e-3, weight_decay=weight_decay)
    for _ in range(real_steps):
        for p in params:
            p.grad = torch.randn(size, generator=generator).to(p.dtype)
        optimizer.step()
    return optimizer


def eager_copy(optimizer):
    """An independent optimizer + params in the same state (deep copies, nothing shared)."""
    return copy.deepcopy(optimizer)


def eager_zero_steps(optimizer, steps, lrs=None):
    for s in range(steps):
        if lrs is not None:
            for group, lr in zip(optimizer.param_groups, lrs[s]):
                group["lr"] = lr
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()


def assert_bitwise_equal(fused, eager):
    fused_params = [p for g in fused.param_groups for p in g["params"]]
    eager_params = [p for g in eager.param_groups for p in g["params"]]
    for p, q in zip(fused_params, eager_params):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fused.state[p][key], eager.state[q][key]), key


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("real_steps", [0, 1, 3])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_fp32_bitwise(size, real_steps, steps, weight_decay):
    fused = make_optimizer([torch.float32], size, real_steps, weight_decay)
    eager = eager_copy(fused)
    zero_grad_adamw_(fused, steps)
    eager_zero_steps(eager, steps)
    assert_bitwise_equal(fused, eager)


@pytest.mark.parametrize("dtypes", [[torch.bfloat16], [torch.float32, torch.bfloat16]])
@pytest.mark.parametrize("real_steps", [0, 3])
@pytest.mark.parametrize("steps", [1, 4])
def test_bf16_and_mixed_groups_bitwise(dtypes, real_steps, steps):
    fused = make_optimizer(dtypes, 100_003, real_steps, 0.01, seed=1)
    eager = eager_copy(fused)
    zero_grad_adamw_(fused, steps)
    eager_zero_steps(eager, steps)
    assert_bitwise_equal(fused, eager)


def test_learning_rate_schedule_between_folded_steps():
    fused = make_optimizer([torch.float32, torch.float32], 5000, 2, 0.01)
    eager = eager_copy(fused)
    lrs = [[1e-3, 3e-3], [5e-4, 2e-3], [2.5e-4, 1e-3]]
    zero_grad_adamw_(fused, 3, lrs=lrs)
    eager_zero_steps(eager, 3, lrs=lrs)
    assert_bitwise_equal(fused, eager)


def test_subnormal_moments():
    fused = make_optimizer([torch.float32], 1000, 1, 0.01)
    (param,) = fused.param_groups[0]["params"]
    state = fused.state[param]
    state["exp_avg"].copy_(torch.linspace(-1e-39, 1e-39, 1000))
    state["exp_avg_sq"].copy_(torch.linspace(0, 2e-40, 1000))
    eager = eager_copy(fused)
    zero_grad_adamw_(fused, 5)
    eager_zero_steps(eager, 5)
    assert_bitwise_equal(fused, eager)


@pytest.mark.parametrize("kwargs,message", [
    ({"amsgrad": True}, "amsgrad"), ({"maximize": True}, "maximize"),
    ({"foreach": True}, "foreach=True"), ({"differentiable": True}, "differentiable")])
def test_unsupported_adamw_options_are_refused(kwargs, message):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], **kwargs)
    with pytest.raises(ValueError, match=message):
        zero_grad_adamw_(optimizer)


def test_other_optimizers_and_bad_steps_are_refused():
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="AdamW"):
        zero_grad_adamw_(torch.optim.Adam([param]))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        zero_grad_adamw_(torch.optim.AdamW([param]), 0)
    with pytest.raises(ValueError, match="lrs must be"):
        zero_grad_adamw_(torch.optim.AdamW([param]), 2, lrs=[[1e-3]])


def test_zg_flat_training_matches_the_eager_zero_grad_path(tmp_path):
    problems = synthetic_problems("train", 10, seed=5)
    results = []
    for fused in (True, False):
        config = TrainConfig.from_arm("zg_flat", steps=10, lr=1e-4, max_new_tokens=64,
                                      fused_zero_grad_step=fused)
        trainer = GRPOTrainer(load_policy("tiny"), config, problems, progress=False,
                              out_dir=tmp_path / str(fused))
        trainer.train()
        results.append(trainer)
    fused, eager = results
    ledger = [json.loads(line) for line in (tmp_path / "True" / "ledger.jsonl").read_text().splitlines()]
    flags = [line["homogeneous"] for line in ledger]
    assert any(flags) and not all(flags), "the run must mix zero-gradient and active steps"
    assert_bitwise_equal(fused.optimizer, eager.optimizer)
