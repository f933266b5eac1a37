"""Shared fixtures: a small random Hugging Face checkpoint written by ``transformers`` itself,
the Triton interpreter switched on when there is no GPU, and tests marked ``cuda`` skipped
there."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU, Triton kernels run in the interpreter on CPU tensors; set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_models import random_hf_model

# ``pytest --hypothesis-profile=probe`` runs the property and fuzz tests with many more examples
# than CI does (the numbers of the reliability probe).
settings.register_profile(
    "probe", max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck)
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(needs_cuda)


@pytest.fixture(scope="session")
def hf_qwen3(tmp_path_factory):
    """(transformers model, directory it was saved to)."""
    model = random_hf_model("qwen3")
    directory = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(directory)
    return model, directory
