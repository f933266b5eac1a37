"""Read and write Hugging Face checkpoint directories (config.json + *.safetensors).

Our modules pack q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the Hugging Face
layout keeps them apart. Loading concatenates, saving splits, so a directory we write loads in
``transformers.AutoModelForCausalLM`` and any Qwen3 checkpoint loads here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlvr_fast.utils.files import replaced_directory
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or has tensors of the wrong shape."""


PACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: unreadable safetensors file ({err})") from None
    return tensors


def hf_to_packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> our module names (q/k/v and gate/up concatenated on dim 0)."""
    out = dict(tensors)
    for name in list(tensors):
        for packed, parts in PACKED.items():
            for suffix in ("weight", "bias"):
                first = f"{parts[0]}.{suffix}"
                if name.endswith(first):
                    prefix = name[: -len(first)]
                    names = [f"{prefix}{part}.{suffix}" for part in parts]
                    missing = [n for n in names if n not in tensors]
                    if missing:
                        raise CheckpointError(f"checkpoint: missing tensor {missing[0]!r}")
                    out[f"{prefix}{packed}.{suffix}"] = torch.cat([tensors[n] for n in names])
                    for n in names:
                        del out[n]
    return out


def packed_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our module names -> Hugging Face names (split back into per-projection tensors)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    sizes = {
        "self_attn.qkv_proj": [q, kv, kv],
        "mlp.gate_up_proj": [config.intermediate_size, config.intermediate_size],
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for packed, parts in PACKED.items():
            if f".{packed}." in name:
                prefix, suffix = name.split(f"{packed}.")
                for part, piece in zip(parts, tensor.split(sizes[packed])):
                    out[f"{prefix}{part}.{suffix}"] = piece.contiguous()
                break
        else:
            out[name] = tensor.contiguous()
    return out


def load_model(
    directory: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Qwen3ForCausalLM:
    """Build the model described by ``directory/config.json`` and load its weights."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    config = ModelConfig.from_file(directory / "config.json")
    return build_model(
        config, read_hf_tensors(directory), device=device, dtype=dtype, source=str(directory)
    )


def build_model(
    config: ModelConfig,
    hf_tensors: dict[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "checkpoint",
) -> Qwen3ForCausalLM:
    """Our model for ``config`` holding copies of ``hf_tensors`` (Hugging Face names, as in a
    checkpoint file or a ``transformers`` model's ``state_dict``); errors name ``source``."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    tensors = hf_to_packed(hf_tensors)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {name: p for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: tensors do not match the config "
            f"(missing: {missing[:3]}, unexpected: {unexpected[:3]})"
        )
    for name, param in expected.items():
        if tensors[name].shape != param.shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)}, "
                f"config implies {tuple(param.shape)}"
            )
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model.to(dtype).eval()


def save_model(model: Qwen3ForCausalLM, directory: str | os.PathLike) -> None:
    """Write config.json + model.safetensors as the whole of ``directory``, atomically."""
    with replaced_directory(directory) as staging:
        write_model_files(model, staging)


def write_model_files(model: Qwen3ForCausalLM, directory: Path) -> None:
    """config.json + model.safetensors into an existing ``directory`` (a staging directory)."""
    state = {name: p.detach().cpu() for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config.to_hf_dict()
    config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    save_file(
        packed_to_hf(state, model.config),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
