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

The kernel (flash-decoding) runs one program per (sequence, KV head, split of the context):
the query heads sharing that KV head are served together (GQA). A split walks its share of the
sequence's tiles, each ``TILE_TOKENS`` tokens (several cache blocks, each block's
[block_size, head_dim] keys and values gathered through the block table once for the whole
group), in a counted loop whose bounds come from the row's length read at run time, which
Triton software-pipelines (the next tiles' loads in flight while one is reduced); it keeps an
online-softmax max, normaliser and weighted sum in fp32 per query head, so no gathered copy of
the sequence's KV is ever made. With one split the program writes the output; with more, each
split writes its (max, normaliser, weighted sum) and a second kernel combines them exactly.
The switch is ``decode_splits``: one split once B x KV heads fills the GPU twice over (every
batch of 33 or more rows of Qwen3-0.6B's 8 KV heads), else as many as fill it (B counted as its
next power of two; the block table's width plays no part, so graph and eager decode split
alike). Splits past a short row's length are empty and exit at once.
block_size and head_dim must be powers of two.
"""

from __future__ import annotations

import math
import os

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
    def _attend_tile(
        p_k,
        p_v,
        p_table,
        p_kv,
        b_q,
        b_len,
        i_tile,
        b_max,
        b_sum,
        b_acc,
        scale,
        stride_kb,
        stride_ks,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """One tile of TILE tokens into the online softmax of the group's queries [G, D]."""
        o_tok = i_tile * TILE + tl.arange(0, TILE)  # [T]
        m_tok = o_tok < b_len
        b_block = tl.load(p_table + o_tok // BLOCK_SIZE, mask=m_tok, other=0).to(tl.int64)
        o_kv = (
            b_block[:, None] * stride_kb
            + (o_tok % BLOCK_SIZE)[:, None] * stride_ks
            + p_kv
            + tl.arange(0, HEAD_DIM)[None, :]
        )
        b_k = tl.load(p_k + o_kv, mask=m_tok[:, None], other=0.0).to(tl.float32)  # [T, D]
        b_v = tl.load(p_v + o_kv, mask=m_tok[:, None], other=0.0).to(tl.float32)  # [T, D]
        b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale  # [G, T]
        b_s = tl.where(m_tok[None, :], b_s, float("-inf"))
        b_new_max = tl.maximum(b_max, tl.max(b_s, axis=1))  # [G]
        b_alpha = tl.exp(b_max - b_new_max)
        b_p = tl.exp(b_s - b_new_max[:, None])  # [G, T]
        b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_v[None, :, :], axis=1)
        return b_new_max, b_sum, b_acc

    @triton.jit
    def _paged_attention_kernel(
        p_q,
        p_k,
        p_v,
        p_tables,
        p_lens,
        p_out,
        p_part_acc,
        p_part_max,
        p_part_sum,
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
        TILE: tl.constexpr,
        SPLITS: tl.constexpr,
        STAGES: tl.constexpr,
        PIPELINED: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        i_kv = tl.program_id(1).to(tl.int64)
        i_s = tl.program_id(2)
        o_g = tl.arange(0, GROUP_PAD)
        m_g = o_g < GROUP
        o_h = i_kv * GROUP + o_g  # the query heads that read KV head i_kv
        o_d = tl.arange(0, HEAD_DIM)
        p_qo = i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q + p_qo, mask=m_g[:, None], other=0.0).to(tl.float32)  # [G, D]
        b_len = tl.load(p_lens + i_b)
        tiles = tl.cdiv(b_len, TILE)
        per_split = tl.cdiv(tiles, SPLITS)
        first = i_s * per_split
        last = tl.minimum(first + per_split, tiles)
        b_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        b_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        b_acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        p_table = p_tables + i_b * stride_tb
        p_kv = i_kv * stride_kh
        # Bounds read at run time end the loop at the row's own length whatever the block
        # table's width (a CUDA graph captures one fixed width). Compiled, a counted loop, which
        # the compiler pipelines; the interpreter cannot take a loaded value as a loop bound
        # (numpy 2 refuses int() of its one-element scalars), so there the same step runs in a
        # while loop.
        if PIPELINED:
            for i_tile in tl.range(first, last, num_stages=STAGES):
                b_max, b_sum, b_acc = _attend_tile(
                    p_k,
                    p_v,
                    p_table,
                    p_kv,
                    b_q,
                    b_len,
                    i_tile,
                    b_max,
                    b_sum,
                    b_acc,
                    scale,
                    stride_kb,
                    stride_ks,
                    BLOCK_SIZE,
                    HEAD_DIM,
                    TILE,
                )
        else:
            i_tile = first
            while i_tile < last:
                b_max, b_sum, b_acc = _attend_tile(
                    p_k,
                    p_v,
                    p_table,
                    p_kv,
                    b_q,
                    b_len,
                    i_tile,
                    b_max,
                    b_sum,
                    b_acc,
                    scale,
                    stride_kb,
                    stride_ks,
                    BLOCK_SIZE,
                    HEAD_DIM,
                    TILE,
                )
                i_tile += 1
        if SPLITS == 1:
            b_out = (b_acc / b_sum[:, None]).to(p_out.dtype.element_ty)
            tl.store(p_out + p_qo, b_out, mask=m_g[:, None])
        else:
            # Partials [B, Hq, SPLITS] (max, normaliser) and [B, Hq, SPLITS, D] (sum).
            o_part = (i_b * (tl.num_programs(1) * GROUP) + o_h) * SPLITS + i_s  # [G]
            tl.store(p_part_max + o_part, b_max, mask=m_g)
            tl.store(p_part_sum + o_part, b_sum, mask=m_g)
            p_acc = p_part_acc + o_part[:, None] * HEAD_DIM + o_d[None, :]
            tl.store(p_acc, b_acc, mask=m_g[:, None])

    @triton.jit
    def _combine_splits_kernel(
        p_part_acc,
        p_part_max,
        p_part_sum,
        p_out,
        stride_qb,
        stride_qh,
        Q_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        i_h = tl.program_id(1).to(tl.int64)
        o_s = tl.arange(0, SPLITS_PAD)
        m_s = o_s < SPLITS
        o_d = tl.arange(0, HEAD_DIM)
        o_part = (i_b * Q_HEADS + i_h) * SPLITS + o_s  # [S]
        b_max = tl.load(p_part_max + o_part, mask=m_s, other=float("-inf"))
        b_sum = tl.load(p_part_sum + o_part, mask=m_s, other=0.0)
        b_acc = tl.load(
            p_part_acc + o_part[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None], other=0.0
        )  # [S, D]
        b_top = tl.max(b_max, axis=0)  # finite: split 0 holds the row's first token
        # An empty split has max -inf and weight exp(-inf) = 0.
        b_weight = tl.exp(b_max - b_top)  # [S]
        b_norm = tl.sum(b_sum * b_weight, axis=0)
        b_out = tl.sum(b_acc * b_weight[:, None], axis=0) / b_norm  # [D]
        p_o = p_out + i_b * stride_qb + i_h * stride_qh + o_d
        tl.store(p_o, b_out.to(p_out.dtype.element_ty))


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Programs that fill an H100 / H200 (132 SMs) twice over; tokens per tile (a multiple of the
# engine's 16-token blocks).
TARGET_PROGRAMS = 2 * 132
TILE_TOKENS = 32
MAX_SPLITS = 16


def decode_splits(batch: int, kv_heads: int) -> int:
    """Splits of the context per (row, KV head): 1 when batch x KV heads fills the GPU, else
    enough to, at most ``MAX_SPLITS``. The batch counts as the next power of two and the block
    table's width not at all, so a decode step splits each row alike whether eager decode runs
    it (B rows, tables as wide as the longest row needs) or a CUDA graph replays it (B padded to
    its bucket, the smallest bucket >= B, whose next power of two is B's; tables of the fixed
    width of max_model_len): a row's split bounds come from its own length and the split
    count, so its logits are the same bits either way."""
    programs = max(1, (1 << (max(1, batch) - 1).bit_length()) * kv_heads)
    return max(1, min(-(-TARGET_PROGRAMS // programs), MAX_SPLITS))


def _attention_launch(q, k_cache, v_cache, block_tables, seq_lens, out, partials, splits):
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    _paged_attention_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        *partials,
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
        TILE=max(TILE_TOKENS, block_size),
        SPLITS=splits,
        STAGES=3,
        PIPELINED=not INTERPRETED,
    )


def _checked(q, k_cache, v_cache, block_tables):
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    return q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_tables.contiguous()


def paged_attention_one_split(q, k_cache, v_cache, block_tables, seq_lens) -> torch.Tensor:
    """The kernel with one split per (row, KV head): [B, Hq, D] in q's dtype."""
    q, k_cache, v_cache, block_tables = _checked(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q)
    _attention_launch(q, k_cache, v_cache, block_tables, seq_lens, out, (out, out, out), 1)
    return out


def paged_attention_splits(
    q, k_cache, v_cache, block_tables, seq_lens, splits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel over ``splits`` splits of each row's context: per (row, query head, split)
    the weighted sum of values [B, Hq, S, D], the running max and the normaliser [B, Hq, S],
    all fp32 (``combine_splits`` finishes them)."""
    q, k_cache, v_cache, block_tables = _checked(q, k_cache, v_cache, block_tables)
    batch, q_heads, head_dim = q.shape
    acc = torch.empty((batch, q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    top = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=q.device)
    norm = torch.empty_like(top)
    _attention_launch(q, k_cache, v_cache, block_tables, seq_lens, q, (acc, top, norm), splits)
    return acc, top, norm


def combine_splits(
    acc: torch.Tensor, top: torch.Tensor, norm: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The splits' partials -> attention output [B, Hq, D] in ``dtype``."""
    batch, q_heads, splits, head_dim = acc.shape
    out = torch.empty((batch, q_heads, head_dim), dtype=dtype, device=acc.device)
    _combine_splits_kernel[(batch, q_heads)](
        acc,
        top,
        norm,
        out,
        out.stride(0),
        out.stride(1),
        Q_HEADS=q_heads,
        HEAD_DIM=head_dim,
        SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
    )
    return out


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """Triton version of ``paged_attention_reference`` (CUDA, or CPU under TRITON_INTERPRET=1).

    Every sequence needs seq_len >= 1; blocks past a sequence's length are never read.
    ``splits``: the context splits (default ``decode_splits``)."""
    _, block_size, kv_heads, _ = k_cache.shape
    splits = splits or decode_splits(q.shape[0], kv_heads)
    if splits == 1:
        return paged_attention_one_split(q, k_cache, v_cache, block_tables, seq_lens)
    partials = paged_attention_splits(q, k_cache, v_cache, block_tables, seq_lens, splits)
    return combine_splits(*partials, q.dtype)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    decode=paged_attention_triton,
) -> torch.Tensor:
    """Triton version of ``paged_prefill_attention_reference``: every query token becomes one
    decode query carrying its row's block table and its own context length, attended by
    ``decode`` (``paged_attention_triton``'s arguments)."""
    rows, q_heads, tokens, head_dim = q.shape
    flat_q = q.transpose(1, 2).reshape(rows * tokens, q_heads, head_dim)
    # One query per row (decode) uses the tables as they are.
    tables = block_tables if tokens == 1 else block_tables.repeat_interleave(tokens, dim=0)
    out = decode(flat_q, k_cache, v_cache, tables, context_lens.reshape(-1))
    return out.view(rows, tokens, q_heads, head_dim).transpose(1, 2)
