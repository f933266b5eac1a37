"""``load_policy``: a model, its tokenizer and its config from a local Hugging Face directory.

``load_policy("tiny")`` loads the embedded default, a small Qwen3-architecture base model that
``scripts/train_tiny.py`` pre-trains on the synthetic arithmetic task and that ships inside the
package (``rlvr_fast/assets/tiny``). Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvr_fast.utils.files import replaced_directory
from rlvr_fast.models.checkpoint import CheckpointError, load_model, write_model_files
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.models.tokenizer import TOKENIZER_FILES, Tokenizer

TINY_MODEL_DIR = Path(__file__).parents[1] / "assets" / "tiny"
EMBEDDED_MODELS = {"tiny": TINY_MODEL_DIR}


@dataclass
class Policy:
    model: Qwen3ForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def num_parameters(self, *, untied: bool = True) -> int:
        """Trainable parameters the way the study counts them (see ModelConfig.num_parameters)."""
        return self.config.num_parameters(untied=untied)

    def save(self, directory: str | os.PathLike) -> None:
        """Write weights, config and tokenizer files as a Hugging Face directory, replacing
        ``directory`` whole and atomically."""
        with replaced_directory(directory) as staging:
            self.write_files(staging)

    def write_files(self, directory: Path) -> None:
        """Weights, config and tokenizer files into an existing ``directory`` (a staging one)."""
        write_model_files(self.model, directory)
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, directory / name)


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    if str(name_or_path) in EMBEDDED_MODELS:
        path = EMBEDDED_MODELS[str(name_or_path)]
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"embedded model {name_or_path!r} is missing from {path}; "
                "reinstall the package or run scripts/train_tiny.py"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: not a model directory (embedded names: {', '.join(EMBEDDED_MODELS)})"
        )
    return path


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 is what the study trains in on the GPU; CPUs run fp32 fastest and exactly.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_policy(
    name_or_path: str | os.PathLike = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    untie: bool = False,
) -> Policy:
    """Load ``"tiny"`` (the embedded default) or a local Hugging Face checkpoint directory.

    ``dtype`` defaults to bfloat16 on CUDA and float32 elsewhere. ``untie=True`` gives a tied
    checkpoint's LM head its own trainable copy of the embedding, the way the study trains
    Qwen3-0.6B-Base.
    """
    device = torch.device(device)
    path = resolve_model_path(name_or_path)
    model = load_model(path, device=device, dtype=dtype or default_dtype(device))
    if untie:
        model.untie_weights()
    return Policy(
        model=model, tokenizer=Tokenizer.from_directory(path), config=model.config, path=path
    )
