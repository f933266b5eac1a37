"""Attention over a paged KV cache: the Triton kernel and the torch reference (gather), for decode
(one query per sequence) and for the prefill of a suffix on top of cached blocks.

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; row b of
``block_tables`` [B, max_blocks] (int32) lists the blocks of sequence b in order and
``seq_lens`` [B] its length. One query token per sequence, q [B, q_heads, head_dim]; query head h
reads KV head h // (q_heads // kv_heads) (GQA). Softmax scale 1/sqrt(head_dim).

Prefill of a suffix: q [R, q_heads, T, head_dim] holds T new tokens per sequence whose keys and
values are already written to the sequence's blocks; query (r, t) attends to the first
``context_lens[r, t]`` tokens of sequence r (its own position + 1 for a causal suffix). The same
kernel serves it, one program per (query token, head), each query with its row's block table.

The kernel runs one program per (sequence, KV head), serving the query heads that share that KV
head together (GQA): it walks the sequence's blocks up to its length (a run-time loop bound),
loads a [block_size, head_dim] tile of keys and values per block through the block table once for
the whole group, and keeps an online-softmax running max, normaliser and weighted sum in fp32 per
query head, so no gathered copy of the sequence's KV is ever made. block_size and head_dim must
be powers of two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton
    triton = None


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Gather every row's blocks into [B, Hkv, M * block_size, D], hide the slots past each
    row's length, and run dense attention: one batched gather per call, no Python loop."""
    return paged_prefill_attention_reference(
        q[:, :, None], k_cache, v_cache, block_tables, seq_lens[:, None]
    )[:, :, 0]


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """q [R, Hq, T, D], context_lens [R, T] -> [R, Hq, T, D]: one gather per row, then dense
    attention with each query's keys limited to its context length."""
    rows, q_heads, _, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    tables = block_tables.long()
    k = k_cache[tables].reshape(rows, -1, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].reshape(rows, -1, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    valid = positions[None, None, :] < context_lens[:, :, None]  # [R, T, L]
    # Slots no query may see hold whatever the cache held (never written, or another
    # sequence's); a masked score is -inf, but 0 * NaN is still NaN, so zero them.
    seen = valid.any(dim=1)[:, None, :, None]  # [R, 1, L, 1]
    k, v = k.masked_fill(~seen, 0.0), v.masked_fill(~seen, 0.0)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=valid[:, None], enable_gqa=q_heads != kv_heads
    )


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        p_q,
        p_k,
        p_v,
        p_tables,
        p_lens,
        p_out,
        scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_tb,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        i_kv = tl.program_id(1).to(tl.int64)
        o_g = tl.arange(0, GROUP_PAD)
        m_g = o_g < GROUP
        o_h = i_kv * GROUP + o_g  # the query heads that read KV head i_kv
        o_d = tl.arange(0, HEAD_DIM)
        o_s = tl.arange(0, BLOCK_SIZE)
        p_qo = i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q + p_qo, mask=m_g[:, None], other=0.0).to(tl.float32)  # [G, D]
        b_len = tl.load(p_lens + i_b)
        b_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        b_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        b_acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        # The loop ends at the row's own length, read at run time, whatever the width of the
        # block table (a CUDA graph captures one fixed width). A while loop, because the
        # interpreter cannot take a loaded value as a range() bound.
        i_blk = 0
        while i_blk * BLOCK_SIZE < b_len:
            o_tok = i_blk * BLOCK_SIZE + o_s
            m_tok = o_tok < b_len
            b_block = tl.load(p_tables + i_b * stride_tb + i_blk).to(tl.int64)
            o_kv = b_block * stride_kb + o_s[:, None] * stride_ks + i_kv * stride_kh + o_d[None, :]
            b_k = tl.load(p_k + o_kv, mask=m_tok[:, None], other=0.0).to(tl.float32)  # [BS, D]
            b_v = tl.load(p_v + o_kv, mask=m_tok[:, None], other=0.0).to(tl.float32)  # [BS, D]
            b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale  # [G, BS]
            b_s = tl.where(m_tok[None, :], b_s, float("-inf"))
            b_new_max = tl.maximum(b_max, tl.max(b_s, axis=1))  # [G]
            b_alpha = tl.exp(b_max - b_new_max)
            b_p = tl.exp(b_s - b_new_max[:, None])  # [G, BS]
            b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
            b_acc = b_acc * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_v[None, :, :], axis=1)
            b_max = b_new_max
            i_blk += 1
        tl.store(
            p_out + p_qo, (b_acc / b_sum[:, None]).to(p_out.dtype.element_ty), mask=m_g[:, None]
        )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Triton version of ``paged_attention_reference`` (CUDA, or CPU under TRITON_INTERPRET=1).

    Every sequence needs seq_len >= 1; blocks past a sequence's length are never read.
    """
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    group = q_heads // kv_heads
    _paged_attention_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        1.0 / math.sqrt(head_dim),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
    return out


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Triton version of ``paged_prefill_attention_reference``: every query token becomes one
    decode query carrying its row's block table and its own context length."""
    rows, q_heads, tokens, head_dim = q.shape
    flat_q = q.transpose(1, 2).reshape(rows * tokens, q_heads, head_dim)
    # One query per row (decode) uses the tables as they are.
    tables = block_tables if tokens == 1 else block_tables.repeat_interleave(tokens, dim=0)
    out = paged_attention_triton(flat_q, k_cache, v_cache, tables, context_lens.reshape(-1))
    return out.view(rows, tokens, q_heads, head_dim).transpose(1, 2)
