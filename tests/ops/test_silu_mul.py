"""SwiGLU's silu(gate) * up from the packed projection: the Triton kernel (under
TRITON_INTERPRET=1 on the CPU) and the C++ path against the reference, fp32 and bf16, odd
widths. bf16 under the interpreter: see tests/ops/test_add_rms_norm.py; here two roundings
(silu, then the product) may each truncate, so the bound allows two ulps."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE, on_device
from rlvr_fast.kernels.silu_mul import silu_mul_reference
from rlvr_fast.ops.silu_mul import silu_mul

SHAPES = [(1, 2), (7, 600), (2, 3, 2 * 3072), (4, 2 * 1500)]


@on_device
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference(shape, dtype):
    gate_up = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(DEVICE, dtype)
    got = silu_mul(gate_up, backend="triton")
    exact = silu_mul_reference(gate_up.double())
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    else:
        eager = silu_mul_reference(gate_up)
        err = lambda t: float((t.double() - exact).abs().max())  # noqa: E731
        assert err(got) <= 2 * err(eager) + 2.0**-6 * float(exact.abs().max())


@pytest.mark.parametrize("shape", SHAPES)
def test_cpp_is_the_torch_ops_bit_for_bit(shape):
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 4
    with torch.inference_mode():
        assert torch.equal(silu_mul(gate_up), silu_mul_reference(gate_up))


def test_training_takes_the_reference():
    gate_up = torch.randn(3, 8, requires_grad=True)
    silu_mul(gate_up).sum().backward()
    assert gate_up.grad is not None
