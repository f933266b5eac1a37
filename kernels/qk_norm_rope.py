"""The attention prologue of one paged pass in one kernel: per-head q/k RMSNorm, rotate-half
RoPE, and the store of the new keys and values into their cache slots.

Input: the packed projection qkv [N, (Hq + 2 Hkv) D] of N tokens (q heads, then k heads, then v
heads, as ``qkv_proj`` writes them), cos and signed sin [N, D] in the activation dtype (the
rotary module's, the first half of sin negated; any shape [..., D] of N rows), the slot of every token [N] int64 and one
layer's cache viewed by slot, key_slots / value_slots [S, Hkv, D].
Output: q [N, Hq, D] and k [N, Hkv, D], normalised and rotated; k and v are also written at
their slots.

Reference (``qk_norm_rope_store_reference``): the decoder's torch ops in their order: each q
head normalised with the q weight and each k head with the k weight (``rms_norm_reference``:
fp32, rounded to the activation dtype, scaled), then ``apply_rope``: x * cos + roll(x) * sin,
each product and the sum rounded to the activation dtype; Qwen2 / Llama (no q/k norm) skip the
norm. The kernel runs one program per token over all its q and k heads as one
[heads, D / 2] x 2 tile (the two halves that rotate into each other), and makes the same
roundings; only the per-head mean of squares is summed in another order.
"""

from __future__ import annotations

import torch

from rlvr_fast.kernels.rms_norm import rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton
    triton = None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1): here
    as x * cos + (x2, x1) * (-sin1, sin2), one roll instead of a split, a negation and a cat,
    and equal to it bit for bit (negating a factor is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [..., (Hq + 2 Hkv) D] -> views q and k together [..., Hq + Hkv, D], v [..., Hkv, D]."""
    heads = qkv.view(*qkv.shape[:-1], -1, head_dim)
    return heads[..., : num_heads + num_kv_heads, :], heads[..., num_heads + num_kv_heads :, :]


def qk_norm_rope_reference(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [..., (Hq + 2 Hkv) D], cos / signed_sin [..., D] -> q [..., Hq, D], k, v [..., Hkv, D]
    (v a view of qkv). No weights: no norm."""
    head_dim = cos.shape[-1]
    qk, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
    if q_weight is not None:
        # Every head normalised on its own: q and k heads in one pass, each with its weight.
        weight = torch.cat((q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)))
        qk = rms_norm_reference(qk, weight, eps)
    qk = apply_rope(qk, cos.unsqueeze(-2), signed_sin.unsqueeze(-2))
    return qk[..., :num_heads, :], qk[..., num_heads:, :], v


def qk_norm_rope_store_reference(
    qkv, q_weight, k_weight, eps, cos, signed_sin, key_slots, value_slots, slot_mapping, num_heads
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of the fused op on N tokens: q [N, Hq, D], k [N, Hkv, D]; k and v stored
    at ``slot_mapping``."""
    head_dim = key_slots.shape[2]
    cos, signed_sin = cos.reshape(-1, head_dim), signed_sin.reshape(-1, head_dim)
    q, k, v = qk_norm_rope_reference(
        qkv, q_weight, k_weight, eps, cos, signed_sin, num_heads, key_slots.shape[1]
    )
    key_slots.index_copy_(0, slot_mapping, k)
    value_slots.index_copy_(0, slot_mapping, v)
    return q, k


if triton is not None:

    @triton.jit
    def _qk_norm_rope_store_kernel(
        p_qkv,
        p_q_weight,
        p_k_weight,
        p_cos,
        p_sin,
        p_slots,
        p_key_slots,
        p_value_slots,
        p_q,
        p_k,
        stride_qkv,
        stride_rope,
        stride_slot,
        eps,
        Q_HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        QK_PAD: tl.constexpr,
        KV_PAD: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
    ):
        i_n = tl.program_id(0).to(tl.int64)
        D: tl.constexpr = 2 * HALF
        o_h = tl.arange(0, QK_PAD)
        m_h = o_h < Q_HEADS + KV_HEADS
        o_d = tl.arange(0, HALF)
        p_row = p_qkv + i_n * stride_qkv
        o_x = o_h[:, None] * D + o_d[None, :]  # [H, HALF]
        b_x1 = tl.load(p_row + o_x, mask=m_h[:, None], other=0.0)
        b_x2 = tl.load(p_row + o_x + HALF, mask=m_h[:, None], other=0.0)
        dtype = b_x1.dtype
        b_x1 = b_x1.to(tl.float32)
        b_x2 = b_x2.to(tl.float32)
        if NORM:
            b_squares = tl.sum(b_x1 * b_x1, axis=1) + tl.sum(b_x2 * b_x2, axis=1)  # [H]
            b_inverse = tl.rsqrt(b_squares / D + eps)[:, None]
            is_q = (o_h < Q_HEADS)[:, None]
            b_w1 = tl.where(
                is_q, tl.load(p_q_weight + o_d)[None, :], tl.load(p_k_weight + o_d)[None, :]
            ).to(tl.float32)
            b_w2 = tl.where(
                is_q,
                tl.load(p_q_weight + HALF + o_d)[None, :],
                tl.load(p_k_weight + HALF + o_d)[None, :],
            ).to(tl.float32)
            b_x1 = (b_w1 * (b_x1 * b_inverse).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            b_x2 = (b_w2 * (b_x2 * b_inverse).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        p_rope = i_n * stride_rope + o_d
        b_cos1 = tl.load(p_cos + p_rope).to(tl.float32)[None, :]
        b_cos2 = tl.load(p_cos + p_rope + HALF).to(tl.float32)[None, :]
        b_sin1 = tl.load(p_sin + p_rope).to(tl.float32)[None, :]
        b_sin2 = tl.load(p_sin + p_rope + HALF).to(tl.float32)[None, :]
        # x * cos + roll(x) * signed_sin, every product and the sum rounded as torch rounds them.
        b_y1 = (b_x1 * b_cos1).to(dtype).to(tl.float32) + (b_x2 * b_sin1).to(dtype).to(tl.float32)
        b_y2 = (b_x2 * b_cos2).to(dtype).to(tl.float32) + (b_x1 * b_sin2).to(dtype).to(tl.float32)
        b_y1 = b_y1.to(dtype)
        b_y2 = b_y2.to(dtype)
        m_q = (o_h < Q_HEADS)[:, None]
        p_qo = p_q + i_n * (Q_HEADS * D) + o_x
        tl.store(p_qo, b_y1, mask=m_q)
        tl.store(p_qo + HALF, b_y2, mask=m_q)
        m_k = ((o_h >= Q_HEADS) & m_h)[:, None]
        o_k = (o_h - Q_HEADS)[:, None] * D + o_d[None, :]  # negative rows are masked off
        p_ko = p_k + i_n * (KV_HEADS * D) + o_k
        tl.store(p_ko, b_y1, mask=m_k)
        tl.store(p_ko + HALF, b_y2, mask=m_k)
        b_slot = tl.load(p_slots + i_n).to(tl.int64)
        p_kc = p_key_slots + b_slot * stride_slot + o_k
        tl.store(p_kc, b_y1, mask=m_k)
        tl.store(p_kc + HALF, b_y2, mask=m_k)
        o_v = tl.arange(0, KV_PAD)
        o_vd = tl.arange(0, D)
        m_v = (o_v < KV_HEADS)[:, None]
        o_vx = o_v[:, None] * D + o_vd[None, :]  # [Hkv, D]
        b_v = tl.load(p_row + (Q_HEADS + KV_HEADS) * D + o_vx, mask=m_v, other=0.0)
        tl.store(p_value_slots + b_slot * stride_slot + o_vx, b_v, mask=m_v)


def qk_norm_rope_store_triton(
    qkv, q_weight, k_weight, eps, cos, signed_sin, key_slots, value_slots, slot_mapping, num_heads
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``qk_norm_rope_store_reference`` on qkv [N, W] (rows may be strided,
    the last dim contiguous), cos / signed_sin [..., D] of N rows; cache slots [S, Hkv, D]
    contiguous per slot. CUDA, or CPU under TRITON_INTERPRET=1."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    tokens = qkv.shape[0]
    _, kv_heads, head_dim = key_slots.shape
    cos, signed_sin = cos.reshape(-1, head_dim), signed_sin.reshape(-1, head_dim)
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None
    _qk_norm_rope_store_kernel[(tokens,)](
        qkv,
        q_weight if norm else qkv,
        k_weight if norm else qkv,
        cos,
        signed_sin,
        slot_mapping,
        key_slots,
        value_slots,
        q,
        k,
        qkv.stride(0),
        cos.stride(0),
        key_slots.stride(0),
        eps,
        Q_HEADS=num_heads,
        KV_HEADS=kv_heads,
        QK_PAD=triton.next_power_of_2(num_heads + kv_heads),
        KV_PAD=triton.next_power_of_2(kv_heads),
        HALF=head_dim // 2,
        NORM=norm,
    )
    return q, k
