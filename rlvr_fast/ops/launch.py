"""``on_device``: the context every kernel wrapper launches in.

Triton launches a kernel on the *current* CUDA device and its current stream, whatever device
the arguments live on, and so does a CUDA-graph capture; torch's own operators follow their
tensors. A run on ``cuda:1`` whose current device is still ``cuda:0`` would launch there. So each
wrapper makes its tensors' device current around its launch; on other devices this is nothing.
"""

from __future__ import annotations

import contextlib

import torch


def on_device(tensor: torch.Tensor):
    """A context in which ``tensor``'s CUDA device is the current device (no-op off CUDA)."""
    if tensor.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)
