"""``load_policy``: a model, its tokenizer and its config from a local Hugging Face directory.

``load_policy("tiny")`` loads the embedded default, a small Qwen3-architecture base model that
``scripts/train_tiny.py`` pre-trains on the synthetic arithmetic task and that ships inside the
package (``rlvr_fast/assets/tiny``). Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvr_fast.models.checkpoint import CheckpointError, load_model, write_model_files
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.lora import ADAPTER_DIR, LoraAdapters
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.models.tokenizer import MAX_TOKENIZER_BYTES, TOKENIZER_FILES, Tokenizer
from rlvr_fast.utils.files import UnreadableFileError, model_file, read_bytes, replaced_directory

TINY_MODEL_DIR = Path(__file__).parents[1] / "assets" / "tiny"
EMBEDDED_MODELS = {"tiny": TINY_MODEL_DIR}


@dataclass
class Policy:
    model: Qwen3ForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    # LoRA adapters on the model (rlvr_fast.models.lora.apply_lora), or None.
    adapters: LoraAdapters | None = None
    # Under shard=fsdp, the sharded copy the optimizer trains (rlvr_fast.train.sharding); the
    # model above is then the engine's full copy, refreshed from it after every step.
    sharded: torch.nn.Module | None = None

    @property
    def trained_model(self) -> torch.nn.Module:
        """The model a loss with gradients runs through: the sharded copy, or the model."""
        return self.model if self.sharded is None else self.sharded

    @contextmanager
    def full_copy_passes(self):
        """Within it, losses without gradients run through the model, the engine's full copy,
        and never through the sharded copy, whose passes are collectives that every rank makes
        together (an evaluation's batches are each rank's own)."""
        sharded, self.sharded = self.sharded, None
        try:
            yield
        finally:
            self.sharded = sharded

    @property
    def decoder(self) -> Qwen3ForCausalLM:
        """The model the rollout engine runs: the model, or with LoRA its merged twin."""
        return self.model if self.adapters is None else self.adapters.decoder

    def refresh_decoder(self) -> None:
        """With LoRA, the decoder's merged weights recomputed in place after a step."""
        if self.adapters is not None:
            self.adapters.refresh()

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def num_parameters(self, *, untied: bool = True) -> int:
        """Trainable parameters the way the study counts them (see ModelConfig.num_parameters)."""
        return self.config.num_parameters(untied=untied)

    def save(
        self, directory: str | os.PathLike, weights: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write weights, config and tokenizer files as a Hugging Face directory, replacing
        ``directory`` whole and atomically; ``weights`` (by parameter name) in place of the
        model's, such as a bf16-mixed run's fp32 masters."""
        with replaced_directory(directory) as staging:
            self.write_files(staging, weights)

    def write_files(self, directory: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Weights, config and tokenizer files into an existing ``directory`` (a staging one).
        The tokenizer files are copied from the model directory the way they were read: regular
        files inside it, bounded (a link out of it is refused, not copied)."""
        if self.adapters is None:
            write_model_files(self.decoder, directory, weights)
        else:
            # LoRA: the merged model (its frozen base has no fp32 copy) and peft's adapter
            # files in adapter/, their tensors ``weights`` (fp32 masters) where given.
            write_model_files(self.decoder, directory)
            (directory / ADAPTER_DIR).mkdir()
            self.adapters.write_files(directory / ADAPTER_DIR, str(self.path), weights)
        for name in TOKENIZER_FILES:
            source = model_file(self.path, name)
            if source is not None:
                (directory / name).write_bytes(
                    read_bytes(source, MAX_TOKENIZER_BYTES, "tokenizer file")
                )


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
    check_tokenizer_files(path)
    tokenizer = Tokenizer.from_directory(path)
    model = load_model(path, device=device, dtype=dtype or default_dtype(device))
    check_vocabulary(tokenizer, model.config, path)
    if untie:
        model.untie_weights()
    return Policy(model=model, tokenizer=tokenizer, config=model.config, path=path)


def check_tokenizer_files(path: Path) -> None:
    """The files ``Policy.save`` copies into a run are checked now, before anything is
    written: regular files inside the directory (a link out would copy a stranger's file)."""
    for name in TOKENIZER_FILES:
        try:
            model_file(path, name)
        except UnreadableFileError as err:
            raise CheckpointError(str(err)) from None


def check_vocabulary(tokenizer: Tokenizer, config: ModelConfig, path: Path) -> None:
    """A tokenizer may have fewer tokens than the model's embedding (Qwen3 pads it), never
    more: its last ids would index past the embedding at the first prompt that uses them."""
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size:,} tokens, more than the "
            f"model's vocabulary (vocab_size {config.vocab_size:,} in config.json)"
        )
