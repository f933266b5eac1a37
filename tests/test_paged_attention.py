"""Paged attention vs contiguous attention; KV storage writes and copy-on-write block copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlvr_fast._C import BlockManager
from rlvr_fast.engine.paged_kv import PagedKVStorage
from rlvr_fast.ops.paged_attention import paged_attention, paged_prefill_attention

BACKENDS = ["torch", "triton", "cpp"] if not torch.cuda.is_available() else ["triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def contiguous_attention(q, keys, values):
    """q [Hq, D], keys / values [L, Hkv, D] -> [Hq, D] with SDPA."""
    out = F.scaled_dot_product_attention(q[:, None, :], keys.transpose(0, 1),
                                         values.transpose(0, 1), enable_gqa=True)
    return out[:, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(4, 4, 32, 16), (6, 2, 64, 16),
                                                                  (8, 1, 32, 8)])
def test_paged_attention_matches_contiguous(backend, q_heads, kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 16, 33, 50]
    manager = BlockManager(64, block_size)
    storage = PagedKVStorage(1, 64, block_size, kv_heads, head_dim, dtype=torch.float32,
                             device=DEVICE)
    contiguous, tables = [], []
    for length in lengths:
        seq = manager.allocate(length)
        k = torch.randn(length, kv_heads, head_dim, generator=generator).to(DEVICE)
        v = torch.randn(length, kv_heads, head_dim, generator=generator).to(DEVICE)
        storage.write_slots(0, manager.token_slots([seq], length).view(-1).to(DEVICE), k, v)
        contiguous.append((k, v))
        tables.append(manager.block_table(seq))
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, :len(table)] = table
    q = torch.randn(len(lengths), q_heads, head_dim, generator=generator).to(DEVICE)
    out = paged_attention(q, storage.keys(0), storage.values(0), block_tables.to(DEVICE),
                          torch.tensor(lengths, device=DEVICE), backend=backend)
    for row, (k, v) in enumerate(contiguous):
        torch.testing.assert_close(out[row], contiguous_attention(q[row], k, v),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_heads,kv_heads,block_size", [(4, 4, 16), (6, 2, 4), (8, 1, 8)])
def test_suffix_prefill_on_cached_blocks_matches_causal_attention(backend, q_heads, kv_heads,
                                                                   block_size):
    """Rows with cached prefixes of 0, 5, 16 and 21 tokens get suffixes of 3, 9, 1 and 6 tokens
    (right-padded to 9); each real suffix query must equal causal attention over prefix + suffix."""
    generator = torch.Generator().manual_seed(1)
    head_dim, prefixes, suffixes = 32, [0, 5, 16, 21], [3, 9, 1, 6]
    width = max(suffixes)
    manager = BlockManager(64, block_size)
    storage = PagedKVStorage(1, 64, block_size, kv_heads, head_dim, dtype=torch.float32,
                             device=DEVICE)
    seqs, full = [], []
    for prefix, suffix in zip(prefixes, suffixes):
        total = prefix + suffix
        seq = manager.allocate(total)
        k = torch.randn(total, kv_heads, head_dim, generator=generator).to(DEVICE)
        v = torch.randn(total, kv_heads, head_dim, generator=generator).to(DEVICE)
        storage.write_slots(0, manager.token_slots([seq], total).view(-1).to(DEVICE), k, v)
        seqs.append(seq)
        full.append((k, v))
    q = torch.randn(len(seqs), q_heads, width, head_dim, generator=generator).to(DEVICE)
    context = torch.ones(len(seqs), width, dtype=torch.long)
    for row, (prefix, suffix) in enumerate(zip(prefixes, suffixes)):
        context[row, :suffix] = torch.arange(prefix + 1, prefix + suffix + 1)
    out = paged_prefill_attention(q, storage.keys(0), storage.values(0),
                                  manager.block_tables(seqs).to(DEVICE), context.to(DEVICE),
                                  backend=backend)
    for row, ((k, v), prefix, suffix) in enumerate(zip(full, prefixes, suffixes)):
        for t in range(suffix):
            end = prefix + t + 1
            expected = contiguous_attention(q[row, :, t], k[:end], v[:end])
            torch.testing.assert_close(out[row, :, t], expected, rtol=1e-5, atol=1e-5)


def test_copy_on_write_keeps_the_parent_intact():
    manager = BlockManager(8, 4)
    storage = PagedKVStorage(2, 8, 4, 1, 2, dtype=torch.float32, device="cpu")
    parent = manager.allocate(6)
    prefix = torch.arange(12.0).view(6, 1, 2)
    for layer in range(2):
        storage.write_slots(layer, manager.token_slots([parent], 6).view(-1), prefix, -prefix)
    child = manager.fork(parent)
    storage.copy_blocks(manager.append(child, 1))
    new = torch.full((1, 1, 2), 99.0)
    for layer in range(2):
        storage.write_slots(layer, manager.token_slots([child], 7)[0, 6:], new, new)
    parent_block = manager.block_table(parent)[1]
    child_block = manager.block_table(child)[1]
    assert parent_block != child_block
    for layer in range(2):
        assert torch.equal(storage.keys(layer)[child_block, :2], prefix[4:6])
        assert torch.equal(storage.keys(layer)[child_block, 2], new[0])
        assert not (storage.keys(layer)[parent_block] == 99).any()


@pytest.mark.parametrize("change,message", [
    (dict(seq_lens=torch.tensor([0])), "seq_lens must lie in"),
    (dict(seq_lens=torch.tensor([40])), "seq_lens must lie in"),
    (dict(block_tables=torch.zeros(1, 2, dtype=torch.int64)), "int32"),
])
def test_bad_inputs_are_refused(change, message):
    args = dict(q=torch.randn(1, 2, 8), k_cache=torch.randn(4, 16, 1, 8),
                v_cache=torch.randn(4, 16, 1, 8), block_tables=torch.zeros(1, 2, dtype=torch.int32),
                seq_lens=torch.tensor([3]))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)
