"""``silu_mul``: SwiGLU's silu(gate) * up from the packed gate_up projection in one op, with the
backend switch of ``rlvr_fast.ops.backends``: the Triton kernel as a ``rlvr_fast::`` custom op
(CUDA, meta), one C++ call (``csrc/silu_mul.cpp``, float32 CPU under inference mode), or the
torch reference (``rlvr_fast.kernels.silu_mul``)."""

from __future__ import annotations

import torch

from rlvr_fast.kernels.silu_mul import silu_mul_reference, silu_mul_triton
from rlvr_fast.ops import launch
from rlvr_fast.ops.backends import inference_backend


@torch.library.custom_op("rlvr_fast::silu_mul", mutates_args=())
def silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    with launch.on_device(gate_up):
        return silu_mul_triton(gate_up)


@silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def silu_mul(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """gate_up [..., 2 I] -> silu(gate_up[..., :I]) * gate_up[..., I:], [..., I]."""
    backend = backend or inference_backend(gate_up)
    if backend == "triton":
        return silu_mul_op(gate_up)
    if backend == "cpp":
        from rlvr_fast._C import silu_mul_cpu  # built by setup.py

        return silu_mul_cpu(gate_up)
    return silu_mul_reference(gate_up)
