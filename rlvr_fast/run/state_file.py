"""A training state (weights, optimizer moments, RNG states, counters) in one safetensors file:
tensors as safetensors tensors, everything else as JSON in the file's header. Nothing is
unpickled, so a crafted file can fail to load but cannot run code.

    save_state(path, {"next_step": 10, "model": model.state_dict(),
                      "optimizer": optimizer.state_dict(), "generator": g.get_state()})
    state = load_state(path)       # the same nesting back, tensors on the CPU

A state is nested dicts, lists and tuples of tensors, strings, numbers, booleans and None, as
``state_dict()`` methods return them; adding an entry (another module's ``state_dict()``) needs
no change here. The header keeps the nesting with every tensor replaced by
``{"tensor": NAME}``; dict keys that are not strings (an optimizer's parameter indices) and
tuples are tagged so they come back as they went in. One file means one atomic rename: a kill
leaves the previous state or the new one.

Format 2 proves itself: the header carries a SHA-256 of the skeleton and of every tensor's name,
dtype, shape and bytes, recomputed on load, so one flipped bit anywhere in the file is refused
(``StateFileError``) before anything is restored. Format 1 (written before digests) still loads;
``read_state`` says it was not checked, and its caller decides (a resume prints one warning line).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlvr_fast.utils.files import atomic_path

HEADER_KEY = "rlvr_fast_state"
FORMAT = "rlvr_fast state 2"
UNDIGESTED_FORMAT = "rlvr_fast state 1"
# Tags of the JSON skeleton. A plain dict is written as {"dict": {...}} so that no key of the
# user's state can be mistaken for a tag.
TENSOR, DICT, INT_KEYS, TUPLE, FLOAT = "tensor", "dict", "int_keys", "tuple", "float"


class StateFileError(ValueError):
    """A state file is missing, truncated, or not a state this module wrote."""


def save_state(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` atomically to ``path`` (a kill leaves the old file whole)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode(state, tensors, {})
    document = {"format": FORMAT, "state": skeleton, "sha256": state_sha256(skeleton, tensors)}
    header = {HEADER_KEY: json.dumps(document, allow_nan=False)}
    with atomic_path(path) as temp:
        save_file(tensors, str(temp), metadata=header)


def state_sha256(skeleton, tensors: dict[str, torch.Tensor]) -> str:
    """The digest of a state: its skeleton (canonical JSON) and each tensor, by name, with its
    dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps(skeleton, sort_keys=True, allow_nan=False).encode())
    for name in sorted(tensors, key=lambda n: (len(n), n)):
        tensor = tensors[name].contiguous()
        digest.update(f"\0{name}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def encode(value, tensors: dict[str, torch.Tensor], seen: dict[tuple, str]):
    """The JSON skeleton of ``value``; its tensors go into ``tensors`` under their position."""
    if isinstance(value, torch.Tensor):
        return {TENSOR: tensor_name(value, tensors, seen)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {DICT: {k: encode(v, tensors, seen) for k, v in value.items()}}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {INT_KEYS: [[k, encode(v, tensors, seen)] for k, v in value.items()]}
        raise TypeError(f"save_state: dict keys must be all str or all int, got {list(value)[:3]}")
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, tensors, seen) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensors, seen) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT: repr(value)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"save_state: cannot store a {type(value).__name__}")


def tensor_name(
    tensor: torch.Tensor, tensors: dict[str, torch.Tensor], seen: dict[tuple, str]
) -> str:
    """One entry per distinct tensor: a tied weight (two names, one storage) is stored once and
    referenced twice. Other tensors that overlap a stored one are copied, as safetensors
    refuses shared storage."""
    tensor = tensor.detach()
    storage = tensor.untyped_storage().data_ptr()
    view = (
        storage,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )
    if view in seen:
        return seen[view]
    name = str(len(tensors))
    overlaps = tensor.numel() > 0 and any(key[0] == storage for key in seen)
    tensors[name] = (tensor.clone() if overlaps else tensor).cpu().contiguous()
    seen[view] = name
    return name


def load_state(path: str | os.PathLike) -> dict:
    """The state ``save_state`` wrote to ``path``, tensors on the CPU."""
    return read_state(path)[0]


def read_state(path: str | os.PathLike) -> tuple[dict, bool]:
    """The state at ``path`` and whether its digest was checked (False: format 1, written
    before digests). A digest that does not match is a ``StateFileError``."""
    path = Path(path)
    if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
        # safetensors would map a FIFO or a device, and block or read without end.
        raise StateFileError(f"{path}: not a regular file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = (handle.metadata() or {}).get(HEADER_KEY)
            if header is None:
                raise StateFileError(
                    f"{path}: not an rlvr_fast state file (no {HEADER_KEY!r} header)"
                )
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except FileNotFoundError:
        raise StateFileError(f"{path}: no such file") from None
    except (SafetensorError, OSError) as err:
        raise StateFileError(f"{path}: unreadable state file ({err})") from None
    try:
        document = json.loads(header)
        if not isinstance(document, dict) or document.get("format") not in (
            FORMAT,
            UNDIGESTED_FORMAT,
        ):
            raise StateFileError(f"{path}: unknown state format")
        digested = document["format"] == FORMAT
        if digested and document.get("sha256") != state_sha256(document["state"], tensors):
            raise StateFileError(
                f"{path}: damaged state file (its contents do not match the SHA-256 it was "
                "written with); resume from an intact copy or start the run anew"
            )
        return decode(document["state"], tensors), digested
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as err:
        if isinstance(err, StateFileError):
            raise
        raise StateFileError(f"{path}: damaged state header ({err})") from None


def decode(skeleton, tensors: dict[str, torch.Tensor]):
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if len(skeleton) != 1:
        raise ValueError(f"untagged object {sorted(skeleton)[:3]}")
    ((tag, body),) = skeleton.items()
    if tag == TENSOR:
        return tensors[body]
    if tag == DICT:
        return {k: decode(v, tensors) for k, v in body.items()}
    if tag == INT_KEYS:
        return {int(k): decode(v, tensors) for k, v in body}
    if tag == TUPLE:
        return tuple(decode(v, tensors) for v in body)
    if tag == FLOAT:
        return float(body)
    raise ValueError(f"unknown tag {tag!r}")
