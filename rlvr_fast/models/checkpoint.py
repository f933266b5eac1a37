"""Read and write Hugging Face checkpoint directories (config.json + *.safetensors).

Our modules pack q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the Hugging Face
layout keeps them apart. Loading copies each part into its rows of the packed parameter, saving
splits, so a directory we write loads in ``transformers.AutoModelForCausalLM`` and any Qwen3
checkpoint loads here.

Loading checks before it reads: the files are regular files inside the directory (a symlink
is resolved and must stay inside it, or in a Hugging Face cache's blobs/:
``rlvr_fast.utils.files.model_file``), config.json is bounded, and every tensor's name, dtype, shape
and byte size come from the safetensors headers and must match the config before any tensor is
read (a crafted 4 GiB q_proj fails in no time and no memory); a tensor in two shards is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlvr_fast.utils.files import (
    UnreadableFileError,
    model_file,
    open_regular,
    parse_json,
    replaced_directory,
)
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or has tensors of the wrong shape,
    dtype or size."""


PACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# safetensors dtypes a weight may have (anything else, an integer tensor say, is not a weight
# this model computes with), with their element sizes.
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
# Elements whose finiteness is checked at once while loading (16 MiB of fp32).
FINITE_CHECK_ELEMENTS = 1 << 22
# safetensors' own limit on a header, checked before the header is read.
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it, before any of it is read."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


@dataclass(frozen=True)
class Slot:
    """Where a Hugging Face tensor goes: rows ``start`` onwards of our parameter ``param``."""

    param: str
    start: int
    shape: tuple[int, ...]


def safetensors_files(directory: Path) -> list[Path]:
    """The directory's ``*.safetensors`` files, each a regular file inside it."""
    names = sorted(path.name for path in directory.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return [checked_file(directory, name) for name in names]


def checked_file(directory: Path, name: str) -> Path:
    try:
        path = model_file(directory, name)
    except UnreadableFileError as err:
        raise CheckpointError(str(err)) from None
    if path is None:
        raise CheckpointError(f"{directory / name}: no such file")
    return path


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, from its header alone: each one's dtype a float,
    its bytes exactly its shape's, inside the file."""
    try:
        with open_regular(path, 1 << 62, "safetensors file") as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header length {length})")
            header = parse_json(file.read(length).decode("utf-8", "replace"), str(path))
    except UnreadableFileError as err:
        raise CheckpointError(str(err)) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    return {
        name: header_entry(path, name, entry, data_bytes, 8 + length)
        for name, entry in header.items()
    }


def header_entry(path: Path, name: str, entry, data_bytes: int, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: not a tensor entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype!r}, not a float ({', '.join(FLOAT_DTYPES)})")
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not two offsets")
    begin, end = offsets
    if end - begin != math.prod(shape) * FLOAT_DTYPES[dtype] or end > data_bytes:
        raise CheckpointError(
            f"{where}: bytes {begin}..{end} do not hold a {dtype} tensor of shape {shape} "
            f"inside the file's {data_bytes:,} data bytes"
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin)


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tensor_index(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint's shards; a tensor in two shards is refused (which one
    would load is an accident of the file order)."""
    index: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name in index:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is also in {index[name].path.name}; "
                    "a tensor belongs to one shard"
                )
            index[name] = entry
    return index


def hf_layout(model: Qwen3ForCausalLM) -> dict[str, Slot]:
    """Hugging Face tensor name -> where it goes in ``model`` (q/k/v and gate/up stacked on
    dim 0 of one parameter); a tied LM head is not a tensor of its own."""
    config = model.config
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    rows = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [config.intermediate_size] * 2}
    layout = {}
    for name, param in model.named_parameters():
        packed = next((p for p in PACKED if f".{p}." in name), None)
        if packed is None:
            layout[name] = Slot(name, 0, tuple(param.shape))
            continue
        prefix, suffix = name.split(f"{packed}.")
        start = 0
        for part, count in zip(PACKED[packed], rows[packed]):
            layout[f"{prefix}{part}.{suffix}"] = Slot(name, start, (count, *param.shape[1:]))
            start += count
    return layout


def check_tensors(
    shapes: dict[str, tuple[int, ...]], layout: dict[str, Slot], tied: bool, source: str
) -> None:
    """Refuse a checkpoint whose tensors (name -> shape) are not the ones ``layout`` expects,
    before any is read."""
    names = set(shapes) - ({"lm_head.weight"} if tied else set())
    missing, unexpected = sorted(set(layout) - names), sorted(names - set(layout))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: tensors do not match the config "
            f"(missing: {missing[:3]}, unexpected: {unexpected[:3]})"
        )
    for name, slot in layout.items():
        if tuple(shapes[name]) != slot.shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(shapes[name])}, config implies {slot.shape}"
            )


def empty_model(config: ModelConfig) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return model


def allocated(model: Qwen3ForCausalLM, device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """``model`` (on meta) given uninitialised parameters of ``dtype`` on ``device``: the one
    copy of the weights that loading fills."""
    model.to(dtype)  # on meta: no memory, so the weights are never held in two dtypes
    model.to_empty(device=device)
    model.tie_weights()
    return model


def slot_view(params: dict[str, torch.nn.Parameter], slot: Slot) -> torch.Tensor:
    """The rows of ``slot.param`` a Hugging Face tensor fills (rows of dim 0: contiguous)."""
    return params[slot.param].detach()[slot.start : slot.start + slot.shape[0]]


def check_finite(target: torch.Tensor, name: str, source: str) -> None:
    """A weight holding NaN or infinity is refused: such a model evaluates to 0% and trains to
    NaN without a word. Checked a slice at a time: ``isfinite`` over a whole embedding makes
    temporaries of its size (1.1 GB for Qwen3-0.6B's in fp32)."""
    for part in target.reshape(-1).split(FINITE_CHECK_ELEMENTS):
        if not bool(torch.isfinite(part).all()):
            raise CheckpointError(f"{source}: {name} holds NaN or infinite values")


def filled(
    model: Qwen3ForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    layout: dict[str, Slot],
    source: str,
) -> Qwen3ForCausalLM:
    """``model`` (allocated) with in-memory ``tensors`` copied into their rows."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors:
            if name in layout:
                target = slot_view(params, layout[name])
                target.copy_(tensor)
                check_finite(target, name, source)
    return model


def read_files(
    model: Qwen3ForCausalLM, index: dict[str, TensorEntry], layout: dict[str, Slot], source: str
) -> Qwen3ForCausalLM:
    """``model`` (allocated) filled from the checkpoint's files, each tensor read (no memory
    map, whose touched pages would count as a second copy of the weights) straight into its
    rows, or through a buffer of its own size when its dtype or device differs: the peak is
    the model plus at most one tensor."""
    params = dict(model.named_parameters())
    for path in sorted({index[name].path for name in layout}):
        names = sorted((n for n in layout if index[n].path == path), key=lambda n: index[n].offset)
        try:
            with open_regular(path, 1 << 62, "safetensors file") as file:
                for name in names:
                    target = slot_view(params, layout[name])
                    read_tensor(file, index[name], target)
                    check_finite(target, name, source)
        except UnreadableFileError as err:
            raise CheckpointError(str(err)) from None
    return model


def read_tensor(file, entry: TensorEntry, target: torch.Tensor) -> None:
    """``entry``'s bytes (little-endian, as safetensors stores them) into ``target``."""
    dtype = TORCH_DTYPES[entry.dtype]
    direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
    buffer = target if direct else torch.empty(entry.shape, dtype=dtype)
    view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
    file.seek(entry.offset)
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise CheckpointError(f"{entry.path}: the file ends inside a tensor")
        done += count
    if not direct:
        with torch.no_grad():
            target.copy_(buffer)


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
    """Build the model described by ``directory/config.json`` and load its weights: every
    tensor's name, shape, dtype and size are checked from the safetensors headers first."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    config = ModelConfig.from_file(checked_file(directory, "config.json"))
    index = tensor_index(safetensors_files(directory))
    model = empty_model(config)
    layout = hf_layout(model)
    shapes = {name: entry.shape for name, entry in index.items()}
    check_tensors(shapes, layout, config.tie_word_embeddings, str(directory))
    return read_files(allocated(model, device, dtype), index, layout, str(directory)).eval()


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
    model = empty_model(config)
    layout = hf_layout(model)
    shapes = {name: tuple(tensor.shape) for name, tensor in hf_tensors.items()}
    check_tensors(shapes, layout, config.tie_word_embeddings, source)
    model = allocated(model, device, dtype)
    return filled(model, iter(hf_tensors.items()), layout, source).eval()


def save_model(model: Qwen3ForCausalLM, directory: str | os.PathLike) -> None:
    """Write config.json + model.safetensors as the whole of ``directory``, atomically."""
    with replaced_directory(directory) as staging:
        write_model_files(model, staging)


def write_model_files(
    model: Qwen3ForCausalLM, directory: Path, weights: dict[str, torch.Tensor] | None = None
) -> None:
    """config.json + model.safetensors into an existing ``directory`` (a staging directory):
    the model's parameters, or in their place ``weights`` of the same names (fp32 masters, say,
    written in their own dtype, which config.json's torch_dtype then names)."""
    state = {name: p.detach().cpu() for name, p in model.named_parameters()}
    state.update({name: t.detach().cpu() for name, t in (weights or {}).items()})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config.to_hf_dict()
    dtype = state["model.embed_tokens.weight"].dtype
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file(
        packed_to_hf(state, model.config),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
