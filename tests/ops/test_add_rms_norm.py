"""RMSNorm alone and after the residual add: the Triton kernel (under TRITON_INTERPRET=1 on the
CPU) and the C++ path against the fp32 reference, over awkward shapes in fp32 and bf16; the
backend switch.

The interpreter casts fp32 to bf16 by truncation (numpy), where the GPU rounds to nearest (the
sm_90 PTX test asserts ``cvt.rn``), so a bf16 result here may sit one bf16 ulp further from the
fp32 reference than eager bf16 does: the bound is the flash-attention rule (at most twice eager's
error) plus one ulp of the output's scale."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE, on_device
from rlvr_fast.ops.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

SHAPES = [((1, 1), 1), ((5, 77), 77), ((3, 7, 128), 128), ((2, 1, 1000), 1000)]
BF16_ULP = 2.0**-7


def make(shape, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    residual = torch.randn(shape, generator=generator)
    weight = torch.randn(dim, generator=generator)
    return [t.to(DEVICE, dtype) for t in (x, residual, weight)]


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max())


def assert_within_bf16_rule(got, eager, exact) -> None:
    scale = float(exact.abs().max())
    assert error(got, exact) <= 2 * error(eager, exact) + BF16_ULP * scale


@on_device
@pytest.mark.parametrize("shape,dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_matches_the_reference(shape, dim, dtype):
    x, _, weight = make(shape, dim, dtype)
    got = rms_norm(x, weight, 1e-6, backend="triton")
    exact = rms_norm_reference(x.double(), weight.double(), 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    else:
        assert_within_bf16_rule(got, rms_norm_reference(x, weight, 1e-6), exact)


@on_device
@pytest.mark.parametrize("shape,dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_add_rms_norm_matches_the_reference(shape, dim, dtype):
    x, residual, weight = make(shape, dim, dtype, seed=1)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6, backend="triton")
    eager_normed, eager_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    exact = rms_norm_reference((x.double() + residual.double()), weight.double(), 1e-6)
    if dtype == torch.float32:
        assert torch.equal(summed, eager_summed), "an fp32 add rounds once, as torch's"
        torch.testing.assert_close(normed.double(), exact, rtol=1e-5, atol=1e-6)
    else:
        assert_within_bf16_rule(summed, eager_summed, x.double() + residual.double())
        assert_within_bf16_rule(normed, eager_normed, exact)


def test_triton_keeps_the_weights_dtype_promotion():
    """An fp32 weight on bf16 activations gives fp32 output (torch's weight * normed)."""
    x, residual, weight = make((4, 64), 64, torch.bfloat16)
    got, summed = add_rms_norm(x, residual, weight.float(), 1e-6, backend="triton")
    eager, _ = add_rms_norm_reference(x, residual, weight.float(), 1e-6)
    assert got.dtype == eager.dtype == torch.float32
    exact = rms_norm_reference(summed.double(), weight.double(), 1e-6)
    assert_within_bf16_rule(got, eager, exact)


@pytest.mark.parametrize("shape,dim", SHAPES)
def test_cpp_add_rms_norm_is_the_add_then_the_cpp_norm_bit_for_bit(shape, dim):
    """What the decoder ran before the fusion, on the CPU: torch's add, then the C++ norm."""
    x, residual, weight = make(shape, dim, torch.float32, seed=2)
    with torch.inference_mode():
        normed, summed = add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, rms_norm(x + residual, weight, 1e-6, backend="cpp"))
    exact = rms_norm_reference(x.double() + residual.double(), weight.double(), 1e-6)
    torch.testing.assert_close(normed.double(), exact, rtol=2e-6, atol=1e-6)


def test_the_switch_takes_the_reference_under_autograd_and_triton_on_meta():
    x, residual, weight = make((3, 16), 16, torch.float32)
    x.requires_grad_()
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    normed.sum().backward()
    assert x.grad is not None and summed.grad_fn is not None
    meta = [t.detach().to("meta") for t in (x, residual, weight)]
    with torch.inference_mode():
        out, total = add_rms_norm(*meta, 1e-6)
    assert out.device.type == total.device.type == "meta" and out.shape == (3, 16)


def test_cpp_refuses_a_residual_of_another_shape():
    from rlvr_fast._C import add_rms_norm_cpu

    with pytest.raises(RuntimeError, match="residual must be float32 of x's shape"):
        add_rms_norm_cpu(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)
