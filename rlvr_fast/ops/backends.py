"""The one switch every fused op resolves its backend with, from its tensors' device, dtype and
whether autograd records them (an op's ``backend=`` argument overrides it; tests use it to run
the Triton kernels on CPU tensors under TRITON_INTERPRET=1).

- "torch": the op's reference, whenever autograd records one of its inputs (training
  differentiates the reference), and wherever no faster path applies;
- "triton": CUDA tensors, and meta tensors, which stand for CUDA ones: ``benchmarks.decode_cost``
  counts the launches of a decode step on the meta device, where each Triton op is a
  ``rlvr_fast::`` custom op whose fake kernel gives the output shapes;
- "cpp": float32 CPU tensors under inference mode (the rollout engine's passes, where a small
  model is dispatch-bound), for ops with a C++ twin in ``csrc/``.
"""

from __future__ import annotations

import torch

TRITON_DEVICES = ("cuda", "meta")


def autograd_records(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def inference_backend(*tensors: torch.Tensor, triton: bool = True, cpp: bool = True) -> str:
    """The backend for an op on ``tensors`` (the first one's device decides); ``triton`` /
    ``cpp``: whether the op has that path for these inputs."""
    if autograd_records(*tensors):
        return "torch"
    device = tensors[0].device.type
    if triton and device in TRITON_DEVICES:
        return "triton"
    if (
        cpp
        and device == "cpu"
        and torch.is_inference_mode_enabled()
        and all(t.dtype == torch.float32 for t in tensors)
    ):
        return "cpp"
    return "torch"
