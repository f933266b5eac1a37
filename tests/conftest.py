"""Shared fixtures: a small random Hugging Face checkpoint written by ``transformers`` itself."""

from __future__ import annotations

import pytest

from hf_models import random_hf_model


@pytest.fixture(scope="session")
def hf_qwen3(tmp_path_factory):
    """(transformers model, directory it was saved to)."""
    model = random_hf_model("qwen3")
    directory = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(directory)
    return model, directory
