"""Paged attention vs contiguous attention; KV storage writes and copy-on-write block copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from devices import CUDA, DEVICE, on_device
from rlvr_fast._C import BlockManager
from rlvr_fast.engine.kv_storage import PagedKVStorage
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.kernels.paged_attention import decode_splits, paged_attention_triton
from rlvr_fast.ops.paged_attention import paged_attention, paged_prefill_attention

BACKENDS = ["triton"] if CUDA else ["torch", "triton", "cpp"]


def empty_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int):
    """k_cache, v_cache [N, block_size, Hkv, D] filled with NaN: a slot read before it is
    written poisons the result."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (
        torch.full(shape, float("nan"), device=DEVICE),
        torch.full(shape, float("nan"), device=DEVICE),
    )


def write_sequence(k_cache, v_cache, table, k, v) -> None:
    """Store k, v [L, Hkv, D] as the first L tokens of the sequence with block table ``table``."""
    block_size = k_cache.shape[1]
    slots = torch.tensor(
        [int(table[p // block_size]) * block_size + p % block_size for p in range(k.shape[0])],
        device=DEVICE,
    )
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v


def store_kv(cache, k, v, slot_mapping) -> None:
    """Write k, v [R, Hkv, T, D] into one layer's cache at slot_mapping [R * T]."""
    slots_shape = cache.key_slots.shape
    cache.key_slots.index_copy_(0, slot_mapping, k.transpose(1, 2).reshape(-1, *slots_shape[1:]))
    cache.value_slots.index_copy_(0, slot_mapping, v.transpose(1, 2).reshape(-1, *slots_shape[1:]))


def contiguous_attention(q, keys, values):
    """q [Hq, D], keys / values [L, Hkv, D] -> [Hq, D] with SDPA."""
    out = F.scaled_dot_product_attention(
        q[:, None, :], keys.transpose(0, 1), values.transpose(0, 1), enable_gqa=True
    )
    return out[:, 0]


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,block_size", [(4, 4, 32, 16), (6, 2, 64, 16), (8, 1, 32, 8)]
)
def test_paged_attention_matches_contiguous(backend, q_heads, kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 16, 33, 50]
    manager = BlockManager(64, block_size)
    k_cache, v_cache = empty_cache(64, block_size, kv_heads, head_dim)
    contiguous, tables = [], []
    for length in lengths:
        seq = manager.allocate(length)
        k = torch.randn(length, kv_heads, head_dim, generator=generator).to(DEVICE)
        v = torch.randn(length, kv_heads, head_dim, generator=generator).to(DEVICE)
        write_sequence(k_cache, v_cache, manager.block_table(seq), k, v)
        contiguous.append((k, v))
        tables.append(manager.block_table(seq))
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = table
    q = torch.randn(len(lengths), q_heads, head_dim, generator=generator).to(DEVICE)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables.to(DEVICE),
        torch.tensor(lengths, device=DEVICE),
        backend=backend,
    )
    for row, (k, v) in enumerate(contiguous):
        torch.testing.assert_close(
            out[row], contiguous_attention(q[row], k, v), rtol=1e-5, atol=1e-5
        )


@on_device
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("block_size", [16, 128])
def test_triton_split_context_matches_contiguous(splits, block_size):
    """Flash-decoding: each row's context split into ``splits`` shares (some empty for short
    rows), tiles of several blocks, the partials combined; bf16 as the GPU decodes."""
    generator = torch.Generator().manual_seed(splits)
    q_heads, kv_heads, head_dim = 4, 2, 32
    lengths = [1, 15, 32, 33, 300]
    manager = BlockManager(64, block_size)
    k_cache, v_cache = empty_cache(64, block_size, kv_heads, head_dim)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    seqs, contiguous = [], []
    for length in lengths:
        seq = manager.allocate(length)
        k = torch.randn(length, kv_heads, head_dim, generator=generator).to(DEVICE, torch.bfloat16)
        v = torch.randn(length, kv_heads, head_dim, generator=generator).to(DEVICE, torch.bfloat16)
        write_sequence(k_cache, v_cache, manager.block_table(seq), k, v)
        seqs.append(seq)
        contiguous.append((k.float(), v.float()))
    q = torch.randn(len(lengths), q_heads, head_dim, generator=generator).to(DEVICE, torch.bfloat16)
    out = paged_attention_triton(
        q,
        k_cache,
        v_cache,
        manager.block_tables(seqs).to(DEVICE),
        torch.tensor(lengths, device=DEVICE),
        splits=splits,
    )
    assert out.dtype == torch.bfloat16
    for row, (k, v) in enumerate(contiguous):
        expected = contiguous_attention(q[row].float(), k, v)
        torch.testing.assert_close(out[row].float(), expected, rtol=2e-2, atol=2e-2)


def test_the_split_switch():
    """One split once rows x KV heads fill the GPU twice over; else enough to, at most 16; the
    batch counts as its next power of two and the table's width not at all (a CUDA graph
    captures one choice for a bucket and a fixed width, which eager decode must make too)."""
    assert decode_splits(64, 8) == 1
    assert decode_splits(8, 8) == 5
    assert decode_splits(1, 8) == 16
    assert decode_splits(5, 8) == decode_splits(8, 8) == 5
    assert [decode_splits(b, 2) for b in (9, 12, 16)] == [9, 9, 9]


def graph_shaped(q, tables, lengths, bucket: int, width: int, scratch_block: int):
    """What a CUDA graph's replay hands the kernel for these rows: the batch padded to its
    bucket with rows of length 1 on the scratch block, every table padded to ``width``."""
    rows = q.shape[0]
    padded_q = torch.cat([q, q.new_zeros((bucket - rows, *q.shape[1:]))])
    padded_tables = torch.full((bucket, width), scratch_block, dtype=torch.int32, device=DEVICE)
    padded_tables[:rows, : tables.shape[1]] = tables
    padded_lengths = torch.cat([lengths, lengths.new_ones(bucket - rows)])
    return padded_q, padded_tables, padded_lengths


@on_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,bucket", [(1, 1), (3, 4), (5, 8), (7, 8), (9, 12)])
def test_graph_and_eager_shapes_give_the_same_bits(rows, bucket, dtype):
    """Eager decode's inputs (B rows, tables only as wide as the longest row needs, not padded)
    and a graph's (B padded to its bucket, the graphs' last one being max_batch = 12 here, and
    tables padded to max_model_len's 32 blocks): every real row's output is the same bits,
    because both take the same split count and a row's split bounds depend on its own length.
    (The split count used to follow the table's width: at 3 rows in fp32, 4 splits eager and 8
    in the graph, and the outputs differed.)"""
    generator = torch.Generator().manual_seed(rows)
    q_heads, kv_heads, head_dim, block_size, width = 4, 2, 32, 8, 32
    lengths = torch.randint(40, 120, (rows,), generator=generator)
    blocks_needed = [-(-int(n) // block_size) for n in lengths]
    shape = (sum(blocks_needed) + 1, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    tables = torch.zeros((rows, max(blocks_needed)), dtype=torch.int32)
    first = 1  # block 0 is the graphs' scratch block
    for row, count in enumerate(blocks_needed):
        tables[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    q = torch.randn(rows, q_heads, head_dim, generator=generator).to(DEVICE, dtype)
    tables, lengths = tables.to(DEVICE), lengths.to(DEVICE)
    assert tables.shape[1] < width, "eager tables narrower than the graphs'"
    eager = paged_attention_triton(q, k_cache, v_cache, tables, lengths)
    padded_q, padded_tables, padded_lengths = graph_shaped(q, tables, lengths, bucket, width, 0)
    graphed = paged_attention_triton(padded_q, k_cache, v_cache, padded_tables, padded_lengths)
    assert decode_splits(rows, kv_heads) == decode_splits(bucket, kv_heads) > 1
    assert torch.equal(graphed[:rows], eager)


@pytest.mark.skipif(CUDA, reason="forces the compiled loop into the interpreter")
@pytest.mark.parametrize("splits", [1, 3])
def test_the_pipelined_loop_computes_what_the_interpreters_loop_does(monkeypatch, splits):
    """Compiled, the kernel walks a row's tiles in a software-pipelined ``tl.range`` whose
    bounds are loaded at run time; the interpreter cannot take a loaded bound (its ``range``
    gets a one-element array), so it runs a while loop over the same step. Here the pipelined
    branch runs in the interpreter (its ``range`` given the loaded bound's value) and gives the
    while loop's bits, on rows of 1 to 4 tiles, some splits empty."""
    import builtins

    import triton.runtime.interpreter as interpreter

    from rlvr_fast.kernels import paged_attention as kernel

    counted_loops = []

    def scalar_range(*args):
        if any(hasattr(a, "handle") for a in args):
            counted_loops.append(args)
        return builtins.range(*(a.handle.data.item() if hasattr(a, "handle") else a for a in args))

    generator = torch.Generator().manual_seed(splits)
    q = torch.randn(3, 4, 32, generator=generator)
    k_cache = torch.randn(16, 8, 2, 32, generator=generator)
    v_cache = torch.randn(16, 8, 2, 32, generator=generator)
    tables = torch.randperm(16, generator=generator)[:15].view(3, 5).to(torch.int32)
    lengths = torch.tensor([1, 33, 40])
    looped = paged_attention_triton(q, k_cache, v_cache, tables, lengths, splits=splits)
    monkeypatch.setattr(interpreter, "range", scalar_range, raising=False)
    monkeypatch.setattr(kernel, "INTERPRETED", False)
    pipelined = paged_attention_triton(q, k_cache, v_cache, tables, lengths, splits=splits)
    assert len(counted_loops) == 3 * 2 * splits, "the pipelined branch ran in every program"
    assert torch.equal(pipelined, looped)


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_heads,kv_heads,block_size", [(4, 4, 16), (6, 2, 4), (8, 1, 8)])
def test_suffix_prefill_on_cached_blocks_matches_causal_attention(
    backend, q_heads, kv_heads, block_size
):
    """Rows with cached prefixes of 0, 5, 16 and 21 tokens get suffixes of 3, 9, 1 and 6 tokens
    (right-padded to 9); each real suffix query must equal causal attention over prefix + suffix."""
    generator = torch.Generator().manual_seed(1)
    head_dim, prefixes, suffixes = 32, [0, 5, 16, 21], [3, 9, 1, 6]
    width = max(suffixes)
    manager = BlockManager(64, block_size)
    k_cache, v_cache = empty_cache(64, block_size, kv_heads, head_dim)
    seqs, full = [], []
    for prefix, suffix in zip(prefixes, suffixes):
        total = prefix + suffix
        seq = manager.allocate(total)
        k = torch.randn(total, kv_heads, head_dim, generator=generator).to(DEVICE)
        v = torch.randn(total, kv_heads, head_dim, generator=generator).to(DEVICE)
        write_sequence(k_cache, v_cache, manager.block_table(seq), k, v)
        seqs.append(seq)
        full.append((k, v))
    q = torch.randn(len(seqs), q_heads, width, head_dim, generator=generator).to(DEVICE)
    context = torch.ones(len(seqs), width, dtype=torch.long)
    for row, (prefix, suffix) in enumerate(zip(prefixes, suffixes)):
        context[row, :suffix] = torch.arange(prefix + 1, prefix + suffix + 1)
    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        manager.block_tables(seqs).to(DEVICE),
        context.to(DEVICE),
        backend=backend,
    )
    for row, ((k, v), prefix, suffix) in enumerate(zip(full, prefixes, suffixes)):
        for t in range(suffix):
            end = prefix + t + 1
            expected = contiguous_attention(q[row, :, t], k[:end], v[:end])
            torch.testing.assert_close(out[row, :, t], expected, rtol=1e-5, atol=1e-5)


def test_copy_on_write_keeps_the_parent_intact():
    """The engine's storage: a fork appends into the shared partial block, the block is copied
    in every layer first, the child's new token lands in the copy and the parent's block is
    untouched."""
    config = ModelConfig.from_hf_dict(
        dict(
            model_type="qwen3",
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=2,
        )
    )
    manager = BlockManager(8, 4)
    storage = PagedKVStorage(config, 8, 4, dtype=torch.float32, device=torch.device("cpu"))
    parent = manager.allocate(0)
    _, slots = manager.append_many([parent], [6])
    prefix = torch.arange(12.0).view(1, 1, 6, 2)  # [R, Hkv, T, D]
    for layer in range(2):
        store_kv(storage.layers[layer], prefix, -prefix, slots)
    child = manager.fork(parent)
    copies, slots = manager.append_batch([child], 1)
    storage.copy_blocks(copies)
    new = torch.full((1, 1, 1, 2), 99.0)
    for layer in range(2):
        store_kv(storage.layers[layer], new, new, slots.view(-1))
    parent_block = manager.block_table(parent)[1]
    child_block = manager.block_table(child)[1]
    assert parent_block != child_block
    for layer in range(2):
        keys = storage.data[layer, 0]
        assert torch.equal(keys[child_block, :2], prefix[0, :, 4:6].transpose(0, 1))
        assert torch.equal(keys[child_block, 2], new[0, :, 0])
        assert torch.equal(
            storage.data[layer, 1, child_block, :2], -prefix[0, :, 4:6].transpose(0, 1)
        )
        assert not (keys[parent_block] == 99).any()
    assert torch.equal(
        storage.data[:, :, storage.scratch_block], torch.zeros_like(storage.data[:, :, 0])
    ), "the scratch block starts zeroed"


def test_cpp_kernel_refuses_a_block_outside_the_cache():
    from rlvr_fast._C import paged_attention_cpu

    k_cache = torch.zeros(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention_cpu(
            torch.randn(1, 2, 1, 8),
            k_cache,
            k_cache,
            torch.tensor([[4]], dtype=torch.int32),
            torch.tensor([[3]]),
        )


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(seq_lens=torch.tensor([0])), "seq_lens must lie in"),
        (dict(seq_lens=torch.tensor([40])), "seq_lens must lie in"),
        (dict(block_tables=torch.zeros(1, 2, dtype=torch.int64)), "int32"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    args = dict(
        q=torch.randn(1, 2, 8),
        k_cache=torch.randn(4, 16, 1, 8),
        v_cache=torch.randn(4, 16, 1, 8),
        block_tables=torch.zeros(1, 2, dtype=torch.int32),
        seq_lens=torch.tensor([3]),
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)
