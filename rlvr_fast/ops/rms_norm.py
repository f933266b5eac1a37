"""``rms_norm`` and ``add_rms_norm`` (the residual add fused in front): RMSNorm over the last dim
in Hugging Face's order, with one switch for the backend (``rlvr_fast.ops.backends``):
- "triton": the Triton kernel (``rlvr_fast.kernels.rms_norm``) as a ``rlvr_fast::`` custom op,
  for CUDA and meta tensors when autograd is not recording (the engine's passes);
- "cpp": one C++ call (``csrc/rms_norm.cpp``) for float32 CPU tensors under inference mode,
  where a small model is dispatch-bound;
- "torch": the reference everywhere else (training, which autograd differentiates).
"""

from __future__ import annotations

import torch

from rlvr_fast.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference, rms_norm_triton
from rlvr_fast.ops import launch
from rlvr_fast.ops.backends import inference_backend

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


@torch.library.custom_op("rlvr_fast::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    with launch.on_device(x):
        return rms_norm_triton(x, weight, eps)[0]


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("rlvr_fast::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with launch.on_device(x):
        return rms_norm_triton(x, weight, eps, residual)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), torch.empty_like(
        x
    )


def _backend(x: torch.Tensor, weight: torch.Tensor, backend: str | None) -> str:
    if backend is not None:
        return backend
    # The kernel takes one weight row; the C++ path also one row per head.
    return inference_backend(x, weight, triton=weight.dim() == 1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None
) -> torch.Tensor:
    """x [..., D]; weight [D] (C++ path: also the shape of x's trailing dims, one row per head).
    Equal to the reference up to float32 rounding of the mean of squares."""
    backend = _backend(x, weight, backend)
    if backend == "triton":
        return rms_norm_op(x, weight, eps)
    if backend == "cpp":
        from rlvr_fast._C import rms_norm_cpu  # built by setup.py

        return rms_norm_cpu(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [..., D] of one dtype, weight [D]."""
    backend = _backend(x, weight, backend)
    if backend == "triton":
        return add_rms_norm_op(x, residual, weight, eps)
    if backend == "cpp":
        from rlvr_fast._C import add_rms_norm_cpu

        return add_rms_norm_cpu(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
