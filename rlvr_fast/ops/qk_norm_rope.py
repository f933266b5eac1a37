"""``qk_norm_rope_store``: the attention prologue of a paged pass (per-head q/k RMSNorm,
rotate-half RoPE, the new keys and values stored in their cache slots) in one op, with the
backend switch of ``rlvr_fast.ops.backends``: the Triton kernel as a ``rlvr_fast::`` custom op
(CUDA, meta), one C++ call (``csrc/qk_norm_rope.cpp``, float32 CPU under inference mode), or
the torch reference. Shapes and roundings: ``rlvr_fast.kernels.qk_norm_rope``.
"""

from __future__ import annotations

import torch

from rlvr_fast.kernels.qk_norm_rope import qk_norm_rope_store_reference, qk_norm_rope_store_triton
from rlvr_fast.ops import launch
from rlvr_fast.ops.backends import inference_backend


@torch.library.custom_op("rlvr_fast::qk_norm_rope_store", mutates_args=("key_slots", "value_slots"))
def qk_norm_rope_store_op(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    with launch.on_device(qkv):
        return qk_norm_rope_store_triton(
            qkv,
            q_weight,
            k_weight,
            eps,
            cos,
            signed_sin,
            key_slots,
            value_slots,
            slot_mapping,
            num_heads,
        )


@qk_norm_rope_store_op.register_fake
def _(
    qkv, q_weight, k_weight, eps, cos, signed_sin, key_slots, value_slots, slot_mapping, num_heads
):
    tokens, (_, kv_heads, head_dim) = qkv.shape[0], key_slots.shape
    return qkv.new_empty(tokens, num_heads, head_dim), qkv.new_empty(tokens, kv_heads, head_dim)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [N, (Hq + 2 Hkv) D]; q_weight, k_weight [D] or both None (no q/k norm); cos,
    signed_sin [..., D] of N rows (the rotary module's [R, T, 1, D]); key_slots, value_slots [S, Hkv, D]; slot_mapping [N] int64. Returns
    q [N, Hq, D] and k [N, Hkv, D] and writes k and v at their slots."""
    args = (qkv, q_weight, k_weight, eps, cos, signed_sin, key_slots, value_slots, slot_mapping)
    backend = backend or inference_backend(
        qkv, *([q_weight, k_weight] if q_weight is not None else []), cos
    )
    if backend == "triton":
        return qk_norm_rope_store_op(*args, num_heads)
    if backend == "cpp":
        from rlvr_fast._C import qk_norm_rope_store_cpu  # built by setup.py

        return qk_norm_rope_store_cpu(*args, num_heads)
    return qk_norm_rope_store_reference(*args, num_heads)
