"""Attention as the decoder's layers run it, given the pass's ``ForwardContext``.

A cache-free pass attends densely (SDPA) with the context's mask. A paged pass first normalises
and rotates q and k and stores the new tokens' keys and values in their cache slots, in one op
(``rlvr_fast.ops.qk_norm_rope``), then attends either densely within the pass (every row fresh:
nothing cached before, so the new tokens are all there is to see) or through the paged cache
with the backend the engine resolved (``rlvr_fast.ops.paged_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlvr_fast.kernels.qk_norm_rope import split_heads
from rlvr_fast.models.context import ForwardContext
from rlvr_fast.ops.paged_attention import paged_prefill_attention
from rlvr_fast.ops.qk_norm_rope import qk_norm_rope_store


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


def attend_paged(
    layer: int,
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    context: ForwardContext,
) -> torch.Tensor:
    """qkv [R, T, (Hq + 2Hkv) D] of this pass's tokens, cos / signed_sin [R, T, 1, D] ->
    [R, Hq, T, D]; stores the tokens' keys and values in layer ``layer``'s cache first."""
    cache = context.kv_cache[layer]
    rows, tokens, width = qkv.shape
    _, kv_heads, head_dim = cache.key_slots.shape
    num_heads = width // head_dim - 2 * kv_heads
    q, k = qk_norm_rope_store(
        qkv.view(rows * tokens, width),
        q_weight,
        k_weight,
        eps,
        cos,
        signed_sin,
        cache.key_slots,
        cache.value_slots,
        context.slot_mapping,
        num_heads,
    )
    q = q.view(rows, tokens, num_heads, head_dim).transpose(1, 2)
    if context.fresh:
        v = split_heads(qkv, num_heads, kv_heads, head_dim)[1]
        k = k.view(rows, tokens, kv_heads, head_dim).transpose(1, 2)
        return dense_attention(q, k, v.transpose(1, 2), None)
    return paged_prefill_attention(
        q,
        cache.keys,
        cache.values,
        context.block_tables,
        context.context_lens,
        backend=context.backend,
        check=False,
    )
