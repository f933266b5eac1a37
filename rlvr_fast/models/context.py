"""``ForwardContext``: what one forward pass of the decoder attends with.

Its caller sets it once per pass (the rollout engine builds one for every prefill and decode
step; a cache-free full-sequence forward builds a dense one), and every attention layer reads
it: the model never holds or receives a cache object. Shapes: R rows of T input tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LayerCache(NamedTuple):
    """One layer's paged keys and values [blocks, block_size, Hkv, D], and the same memory
    viewed by slot [blocks * block_size, Hkv, D] (made once, not per pass)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_slots: torch.Tensor
    value_slots: torch.Tensor


@dataclass
class ForwardContext:
    """positions [R, T] int64: each input token's position (RoPE).

    Cache-free pass (``kv_cache`` None): ``mask`` [R, 1, T, T] bool, or None for causal.

    Paged pass: ``kv_cache`` is the engine's storage, a ``LayerCache`` per layer; every layer
    stores the keys and values of the R * T input tokens at ``slot_mapping`` [R * T]
    int64 (padding tokens go to a scratch slot no sequence owns), then attends. ``fresh``: no row
    had cached tokens before this pass, so attention runs causally within the pass (rows are
    right-padded) and never reads the cache; otherwise query (r, t) attends to the first
    ``context_lens[r, t]`` cached tokens of row r through ``block_tables`` [R, M] int32, with
    the paged-attention ``backend`` the engine resolved once.

    ``logits_index`` [R] int64: flat index r * T + t of each row's last real token, whose logits
    the pass returns (None when T = 1).
    """

    positions: torch.Tensor
    mask: torch.Tensor | None = None
    kv_cache: list[LayerCache] | None = None
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    fresh: bool = False
    backend: str | None = None
    logits_index: torch.Tensor | None = None
