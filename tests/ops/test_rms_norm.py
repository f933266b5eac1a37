"""RMSNorm: the C++ inference path against the torch reference; the switch between them."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.ops.rms_norm import rms_norm, rms_norm_reference


@pytest.mark.parametrize(
    "shape,weight_shape",
    [((8, 1, 128), (128,)), ((3, 7, 6, 32), (6, 32)), ((5, 77), (77,)), ((1, 1, 1), (1,))],
)
def test_cpp_path_matches_the_reference(shape, weight_shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(weight_shape, generator=generator)
    expected = rms_norm_reference(x.double(), weight.double(), 1e-6)
    with torch.inference_mode():
        fast = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(fast.double(), expected, rtol=2e-6, atol=1e-6)
    assert fast.dtype == torch.float32 and fast.shape == x.shape


def test_training_and_other_dtypes_take_the_reference():
    x = torch.randn(4, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    rms_norm(x, weight, 1e-6).sum().backward()
    assert x.grad is not None and weight.grad is not None
    xb, wb = x.detach().bfloat16(), weight.detach().bfloat16()
    with torch.inference_mode():
        assert torch.equal(rms_norm(xb, wb, 1e-6), rms_norm_reference(xb, wb, 1e-6))


def test_cpp_path_refuses_a_weight_of_another_shape():
    from rlvr_fast._C import rms_norm_cpu

    with pytest.raises(RuntimeError, match="trailing dims"):
        rms_norm_cpu(torch.randn(2, 3, 8), torch.randn(2, 8), 1e-6)
