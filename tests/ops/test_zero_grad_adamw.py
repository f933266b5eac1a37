"""zero_grad_adamw_: bitwise equal to k rounds of {p.grad = zeros; AdamW.step()}."""

from __future__ import annotations

import copy
import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from devices import CUDA, DEVICE, on_device
from rlvr_fast.ops import zero_grad_adamw
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.kernels import zero_grad_adamw as kernel
from rlvr_fast.ops.zero_grad_adamw import zero_grad_adamw_
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig

SIZES = (1, 7, 1000, 100_003)


def make_optimizer(dtypes, size, real_steps, weight_decay, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(size, generator=generator).to(dtype)) for dtype in dtypes
    ]
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


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"maximize": True}, "maximize"),
        ({"foreach": True}, "foreach=True"),
        ({"differentiable": True}, "differentiable"),
    ],
)
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
        config = TrainConfig.from_arm(
            "zg_flat", steps=10, lr=1e-4, max_new_tokens=64, fused_zero_grad_step=fused
        )
        trainer = RLVRTrainer(
            load_policy("tiny"), config, problems, progress=False, out_dir=tmp_path / str(fused)
        )
        trainer.train()
        results.append(trainer)
    fused, eager = results
    ledger = [
        json.loads(line) for line in (tmp_path / "True" / "ledger.jsonl").read_text().splitlines()
    ]
    flags = [line["homogeneous"] for line in ledger]
    assert any(flags) and not all(flags), "the run must mix zero-gradient and active steps"
    assert_bitwise_equal(fused.optimizer, eager.optimizer)


# ---- CUDA: the Triton kernel (rlvr_fast.kernels.zero_grad_adamw) -------------------------------
# Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors and is compared with the
# pure-torch emulation of torch's CUDA foreach rounding; with a GPU both are also compared with
# torch's own CUDA AdamW.


@pytest.fixture
def exact_interpreter_fma(monkeypatch):
    """The interpreter computes ``tl.fma`` as x * y + z in numpy float32, rounding twice, so it
    could not tell a fused multiply-add from an unfused one. Give it the correctly rounded fma
    that the GPU's fma.rn computes; the kernel is then checked with the fma it runs on a GPU."""
    if CUDA:
        return
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        a, b, c = (
            torch.from_numpy(np.ascontiguousarray(t.data, dtype=np.float32)) for t in (x, y, z)
        )
        return interpreter.TensorHandle(kernel.fma_float32(a, b, c).numpy(), z.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)


def make_device_optimizer(dtypes, sizes, real_steps, weight_decay, betas=(0.9, 0.999), seed=0):
    """AdamW over one tensor per (dtype, size) on DEVICE, in two groups, after ``real_steps``
    steps with random gradients."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(size, generator=generator).to(DEVICE, dtype))
        for dtype in dtypes
        for size in sizes
    ]
    half = max(1, len(params) // 2)
    groups = [{"params": params[:half]}]
    if params[half:]:
        groups.append({"params": params[half:], "lr": 3e-3, "weight_decay": 0.1, "eps": 1e-6})
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=betas, weight_decay=weight_decay)
    for _ in range(real_steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(DEVICE, p.dtype)
        optimizer.step()
    for p in params:
        p.grad = None
    return optimizer


def fold_with(optimizer, steps, lrs, fold):
    """What zero_grad_adamw_ does with CUDA parameters of foreach groups, on DEVICE: the steps of
    every tensor of one dtype folded by one call of ``fold`` with zero_grad_adamw_'s scalars."""
    members = {}
    for index, group in enumerate(optimizer.param_groups):
        group_lrs = [group["lr"]] * steps if lrs is None else [r[index] for r in lrs]
        for p in group["params"]:
            members.setdefault(p.dtype, []).append((p, group, group_lrs))
    for dtype_members in members.values():
        zero_grad_adamw._fold_foreach(optimizer, dtype_members, fold)


def triton_fold(optimizer, steps, lrs=None):
    fold_with(optimizer, steps, lrs, kernel.zero_grad_adamw_triton_)


def emulated_fold(optimizer, steps, lrs=None):
    fold_with(optimizer, steps, lrs, kernel.zero_grad_adamw_reference_)


def test_fma_float32_is_correctly_rounded():
    # 1 + 2^-23 + 2^-24 - 2^-70: the float64 sum rounds to the float32 tie 1 + 2^-23 + 2^-24,
    # which ties-to-even would take up to 1 + 2^-22; the exact value is below the tie.
    a = torch.tensor([2.0**-24 * (1 + 2.0**-23)])
    b = torch.tensor([1 - 2.0**-23])
    c = torch.tensor([1 + 2.0**-23])
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2.0**-22
    assert kernel.fma_float32(a, b, c).item() == 1 + 2.0**-23
    generator = torch.Generator().manual_seed(0)
    a, b, c = (
        torch.randn(3000, generator=generator)
        * 2.0 ** torch.randint(-30, 30, (3000,), generator=generator)
        for _ in range(3)
    )
    fused = kernel.fma_float32(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), fused.tolist()):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        below = np.nextafter(np.float32(r), np.float32(-np.inf))
        above = np.nextafter(np.float32(r), np.float32(np.inf))
        error = abs(exact - Fraction(r))
        assert error <= abs(exact - Fraction(float(below)))
        assert error <= abs(exact - Fraction(float(above)))


def test_sqrt_float32_is_correctly_rounded():
    generator = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(200_000, generator=generator)
            * 2.0 ** torch.randint(-140, 100, (200_000,), generator=generator),
            torch.tensor([0.0, 1e-45, 4.0]),
        ]
    )
    assert torch.equal(kernel.sqrt_float32(x), torch.from_numpy(np.sqrt(x.numpy())))


# The interpreter runs one Python program per block of 2048 elements, so the full matrix uses
# tensors of up to 5003 elements (three blocks, the last partial); 100_003 has its own case.
INTERPRETER_SIZES = (1, 7, 1000, 5003)


@on_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("real_steps", [0, 1, 3])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_triton_kernel_matches_emulation(
    exact_interpreter_fma, dtype, real_steps, steps, weight_decay
):
    fused = make_device_optimizer([dtype], INTERPRETER_SIZES, real_steps, weight_decay)
    emulated = eager_copy(fused)
    triton_fold(fused, steps)
    emulated_fold(emulated, steps)
    assert_bitwise_equal(fused, emulated)


@on_device
def test_triton_kernel_matches_emulation_on_large_mixed_dtype_tensors(exact_interpreter_fma):
    fused = make_device_optimizer([torch.float32, torch.bfloat16], SIZES, 3, 0.01)
    emulated = eager_copy(fused)
    triton_fold(fused, 4)
    emulated_fold(emulated, 4)
    assert_bitwise_equal(fused, emulated)


@on_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_emulation_on_aligned_tensors(exact_interpreter_fma, dtype):
    """Sizes that are multiples of 8 take the kernel's 16-byte-access variant."""
    fused = make_device_optimizer([dtype], [8, 2048, 4104], 1, 0.01)
    emulated = eager_copy(fused)
    triton_fold(fused, 3)
    emulated_fold(emulated, 3)
    assert_bitwise_equal(fused, emulated)


@on_device
def test_triton_kernel_matches_emulation_across_a_learning_rate_schedule(exact_interpreter_fma):
    fused = make_device_optimizer([torch.float32, torch.bfloat16], [7, 5000], 2, 0.01)
    emulated = eager_copy(fused)
    lrs = [[1e-3, 3e-3], [5e-4, 2e-3], [2.5e-4, 1e-3]]
    triton_fold(fused, 3, lrs)
    emulated_fold(emulated, 3, lrs)
    assert_bitwise_equal(fused, emulated)


@on_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_emulation_on_subnormal_moments(exact_interpreter_fma, dtype):
    fused = make_device_optimizer([dtype], [1000], 1, 0.01)
    (param,) = fused.param_groups[0]["params"]
    low = 1e-39 if dtype == torch.float32 else 1e-38
    fused.state[param]["exp_avg"].copy_(torch.linspace(-low, low, 1000))
    fused.state[param]["exp_avg_sq"].copy_(torch.linspace(0, low / 5, 1000))
    emulated = eager_copy(fused)
    triton_fold(fused, 5)
    emulated_fold(emulated, 5)
    assert_bitwise_equal(fused, emulated)


@on_device
def test_triton_kernel_matches_emulation_with_a_large_lerp_weight(exact_interpreter_fma):
    """beta1 = 0.3 takes lerp's other branch (weight 0.7 >= 0.5)."""
    fused = make_device_optimizer(
        [torch.float32, torch.bfloat16], [1000], 2, 0.01, betas=(0.3, 0.999)
    )
    emulated = eager_copy(fused)
    triton_fold(fused, 3)
    emulated_fold(emulated, 3)
    assert_bitwise_equal(fused, emulated)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtypes", [[torch.float32], [torch.bfloat16], [torch.float32, torch.bfloat16]]
)
@pytest.mark.parametrize("real_steps", [0, 1, 3])
@pytest.mark.parametrize("steps", [1, 4, 5])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_cuda_fold_is_bitwise_equal_to_torch_cuda_adamw(dtypes, real_steps, steps, weight_decay):
    fused = make_device_optimizer(dtypes, SIZES, real_steps, weight_decay)
    eager, emulated = eager_copy(fused), eager_copy(fused)
    zero_grad_adamw_(fused, steps)
    eager_zero_steps(eager, steps)
    emulated_fold(emulated, steps)
    assert_bitwise_equal(emulated, eager)
    assert_bitwise_equal(fused, eager)


@pytest.mark.cuda
def test_cuda_fold_across_a_learning_rate_schedule_and_subnormal_moments():
    fused = make_device_optimizer([torch.float32, torch.bfloat16], [1000, 100_003], 2, 0.01)
    for param in (p for g in fused.param_groups for p in g["params"]):
        fused.state[param]["exp_avg"][:1000].copy_(torch.linspace(-1e-38, 1e-38, 1000))
        fused.state[param]["exp_avg_sq"][:1000].copy_(torch.linspace(0, 2e-39, 1000))
    eager = eager_copy(fused)
    lrs = [[1e-3, 3e-3], [5e-4, 2e-3], [2.5e-4, 1e-3]]
    zero_grad_adamw_(fused, 3, lrs=lrs)
    eager_zero_steps(eager, 3, lrs=lrs)
    assert_bitwise_equal(fused, eager)


@pytest.mark.cuda
def test_cuda_foreach_false_takes_torch_single_tensor_steps():
    fused = make_device_optimizer([torch.float32], [1000], 1, 0.01)
    for group in fused.param_groups:
        group["foreach"] = False
    eager = eager_copy(fused)
    zero_grad_adamw_(fused, 2)
    eager_zero_steps(eager, 2)
    assert_bitwise_equal(fused, eager)
