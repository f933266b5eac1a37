"""``rms_norm``: RMSNorm over the last dim in Hugging Face's order, with one switch for the
backend: a single C++ call (``csrc/rms_norm.cpp``) for float32 CPU tensors under inference mode
(the rollout engine's passes, where a small model is dispatch-bound), the torch reference
everywhere else (training, which autograd differentiates; other dtypes; CUDA).
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise over the last dim in fp32, round to the input dtype, then scale (``weight``
    broadcasts against x). Written out because on CPU F.rms_norm dispatches to the same ops
    plus a slower wrapper."""
    # The dtype checks skip two no-op casts per call in fp32.
    x32 = x if x.dtype == torch.float32 else x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D]; weight [D], or the shape of x's trailing dims. Equal to the reference up to
    float32 rounding (the C++ path sums squares in another order)."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and torch.is_inference_mode_enabled()
    ):
        from rlvr_fast._C import rms_norm_cpu  # built by setup.py

        return rms_norm_cpu(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
