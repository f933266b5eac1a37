"""Where device tests run: on the GPU when the machine has one, else on the CPU (Triton kernels
under the interpreter). On a GPU machine such a test exercises CUDA, so ``on_device`` gives it
the ``cuda`` marker there and the GPU suite's ``pytest -m cuda`` selects it with the CUDA-only
tests (``@pytest.mark.cuda``, skipped without a GPU by ``conftest.py``)."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def on_device(test):
    return pytest.mark.cuda(test) if CUDA else test
