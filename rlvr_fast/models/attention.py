"""Attention as the decoder's layers run it, given the pass's ``ForwardContext``.

A cache-free pass attends densely (SDPA) with the context's mask. A paged pass first stores the
new tokens' keys and values in their cache slots, then attends either densely within the pass
(every row fresh: nothing cached before, so the new tokens are all there is to see) or through
the paged cache with the backend the engine resolved (``rlvr_fast.ops.paged_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlvr_fast.models.context import ForwardContext, LayerCache
from rlvr_fast.ops.paged_attention import paged_prefill_attention


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [B, Hq, Tq, D], k / v [B, Hkv, Tk, D]; causal when no mask is given and Tq > 1."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q.shape[2] > 1,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def store_kv(
    cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [R, Hkv, T, D] into one layer's cache at slot_mapping [R * T] (row-major over
    (r, t))."""
    slots_shape = cache.key_slots.shape
    cache.key_slots.index_copy_(0, slot_mapping, k.transpose(1, 2).reshape(-1, *slots_shape[1:]))
    cache.value_slots.index_copy_(0, slot_mapping, v.transpose(1, 2).reshape(-1, *slots_shape[1:]))


def attend(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ForwardContext
) -> torch.Tensor:
    """q [R, Hq, T, D], k / v [R, Hkv, T, D] of this pass's tokens -> [R, Hq, T, D]."""
    if context.kv_cache is None:
        return dense_attention(q, k, v, context.mask)
    cache = context.kv_cache[layer]
    store_kv(cache, k, v, context.slot_mapping)
    if context.fresh:
        return dense_attention(q, k, v, None)
    return paged_prefill_attention(
        q,
        cache.keys,
        cache.values,
        context.block_tables,
        context.context_lens,
        backend=context.backend,
        check=False,
    )
