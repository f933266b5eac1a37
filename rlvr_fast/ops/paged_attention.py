"""``paged_attention``: one decode query per sequence against a paged KV cache;
``paged_prefill_attention``: a suffix of new tokens per sequence on top of its cached blocks.

CUDA (and meta) tensors use the Triton kernel, split over the context for small batches, each
launch a ``rlvr_fast::`` custom op; float32 CPU tensors the C++ kernel
(``csrc/paged_attention.cpp``); both read the blocks in place through the block tables. Other
CPU tensors use the torch reference (gather). ``default_backend`` is the one switch: the rollout
engine resolves it once per run; ``backend=`` overrides it (tests run the Triton kernel on CPU
under TRITON_INTERPRET=1). Shapes, semantics and the split switch are documented in
``rlvr_fast.kernels.paged_attention``.
"""

from __future__ import annotations

import torch

from rlvr_fast.kernels.paged_attention import (
    combine_splits,
    decode_splits,
    paged_attention_one_split,
    paged_attention_reference,
    paged_attention_splits,
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
)
from rlvr_fast.ops import launch
from rlvr_fast.ops.backends import TRITON_DEVICES


@torch.library.custom_op("rlvr_fast::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    return paged_attention_one_split(q, k_cache, v_cache, block_tables, seq_lens)


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens):
    return torch.empty_like(q)


@torch.library.custom_op("rlvr_fast::paged_attention_splits", mutates_args=())
def paged_attention_splits_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return paged_attention_splits(q, k_cache, v_cache, block_tables, seq_lens, splits)


@paged_attention_splits_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, splits):
    batch, q_heads, head_dim = q.shape
    top = q.new_empty((batch, q_heads, splits), dtype=torch.float32)
    return q.new_empty((batch, q_heads, splits, head_dim), dtype=torch.float32), top, top.clone()


@torch.library.custom_op("rlvr_fast::combine_splits", mutates_args=())
def combine_splits_op(
    acc: torch.Tensor, top: torch.Tensor, norm: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return combine_splits(acc, top, norm, dtype)


@combine_splits_op.register_fake
def _(acc, top, norm, dtype):
    batch, q_heads, _, head_dim = acc.shape
    return acc.new_empty((batch, q_heads, head_dim), dtype=dtype)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens):
    """The Triton kernel, one launch per custom op: unsplit, or splits then their combine."""
    splits = decode_splits(q.shape[0], k_cache.shape[2])
    if splits == 1:
        return paged_attention_op(q, k_cache, v_cache, block_tables, seq_lens)
    partials = paged_attention_splits_op(q, k_cache, v_cache, block_tables, seq_lens, splits)
    return combine_splits_op(*partials, q.dtype)


def paged_prefill_attention_triton_ops(q, k_cache, v_cache, block_tables, context_lens):
    return paged_prefill_attention_triton(
        q, k_cache, v_cache, block_tables, context_lens, decode=paged_attention_triton
    )


def paged_prefill_attention_cpp(q, k_cache, v_cache, block_tables, context_lens):
    from rlvr_fast._C import paged_attention_cpu  # built with the block manager

    lens = context_lens if context_lens.dtype == torch.int64 else context_lens.long()
    return paged_attention_cpu(q, k_cache, v_cache, block_tables, lens)


def paged_attention_cpp(q, k_cache, v_cache, block_tables, seq_lens):
    return paged_prefill_attention_cpp(
        q[:, :, None], k_cache, v_cache, block_tables, seq_lens[:, None]
    )[:, :, 0]


BACKENDS = {
    "torch": paged_attention_reference,
    "triton": paged_attention_triton,
    "cpp": paged_attention_cpp,
}
PREFILL_BACKENDS = {
    "torch": paged_prefill_attention_reference,
    "triton": paged_prefill_attention_triton_ops,
    "cpp": paged_prefill_attention_cpp,
}


def default_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The paged-attention backend for a cache on ``device`` holding ``dtype``."""
    if device.type in TRITON_DEVICES:
        return "triton"
    return "cpp" if dtype == torch.float32 else "torch"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    backend: str | None = None,
    check: bool = True,
) -> torch.Tensor:
    """q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, M]
    int32; seq_lens [B] (each >= 1 and <= M * block_size). Returns [B, Hq, D] in q's dtype.

    ``check=False`` skips the input checks (they read seq_lens, a device sync on CUDA); the
    rollout engine, which builds its own inputs, uses it on every pass.
    """
    backend = backend or default_backend(q.device, k_cache.dtype)
    if check:
        _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, backend)
    with launch.on_device(q):
        return BACKENDS[backend](q, k_cache, v_cache, block_tables, seq_lens)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    backend: str | None = None,
    check: bool = True,
) -> torch.Tensor:
    """q [R, Hq, T, D] (T new tokens per row, their keys and values already in the cache);
    block_tables [R, M] int32; context_lens [R, T]: query (r, t) attends to the first
    context_lens[r, t] tokens of row r (each >= 1). Returns [R, Hq, T, D] in q's dtype."""
    backend = backend or default_backend(q.device, k_cache.dtype)
    if check:
        if q.dim() != 4 or context_lens.shape != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"q must be [R, Hq, T, D] and context_lens [R, T], got "
                f"{tuple(q.shape)} and {tuple(context_lens.shape)}"
            )
        rows, q_heads, tokens, head_dim = q.shape
        _check_inputs(
            q.transpose(1, 2).reshape(rows * tokens, q_heads, head_dim),
            k_cache,
            v_cache,
            block_tables.repeat_interleave(tokens, dim=0),
            context_lens.reshape(-1),
            backend,
        )
    with launch.on_device(q):
        return PREFILL_BACKENDS[backend](q, k_cache, v_cache, block_tables, context_lens)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, backend) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [B, Hq, D] and k_cache / v_cache one [N, S, Hkv, D] shape, "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or q_heads % kv_heads:
        raise ValueError(
            f"head_dim {head_dim} vs cache {k_cache.shape[3]}, or {q_heads} query "
            f"heads not a multiple of {kv_heads} KV heads"
        )
    if block_tables.dtype != torch.int32 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be int32 [B={batch}, max_blocks]")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}]")
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > capacity:
        raise ValueError(f"seq_lens must lie in [1, {capacity}] (block table width x block size)")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
