"""Paged attention, one decode query per sequence: the gather reference (eager) vs the default
backend (the C++ kernel on CPU, the Triton kernel on CUDA), both reading the same block tables.
CPU: the tiny model's heads; CUDA: Qwen3-0.6B's (16 query / 8 KV heads, head_dim 128, bf16).
8 sequences of 1,024 cached tokens in 16-token blocks. Also KV blocks held by a K=4 x B=2 tree
(4 roots forked twice at a 128-token prefix) vs 8 flat rows, every leaf at 512 tokens.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast._C import BlockManager
from rlvr_fast.ops.paged_attention import paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS, CONTEXT, BLOCK = 8, 1024, 16
HEADS = (16, 8, 128, torch.bfloat16) if DEVICE.type == "cuda" else (4, 2, 32, torch.float32)


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_paged_decode_attention(benchmark, role):
    q_heads, kv_heads, head_dim, dtype = HEADS
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    blocks = ROWS * CONTEXT // BLOCK
    k_cache = torch.randn(blocks, BLOCK, kv_heads, head_dim, device=DEVICE, generator=generator).to(
        dtype
    )
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=DEVICE, generator=generator).view(ROWS, -1).int()
    q = torch.randn(ROWS, q_heads, head_dim, device=DEVICE, generator=generator).to(dtype)
    lengths = torch.full((ROWS,), CONTEXT, device=DEVICE)
    backend = "torch" if role == "eager" else None

    def run():
        paged_attention(q, k_cache, v_cache, tables, lengths, backend=backend, check=False)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    mark(
        benchmark,
        f"paged decode attention, {ROWS} x {CONTEXT} tokens, {DEVICE.type}",
        role,
        work=ROWS,
        unit="rows",
    )
    benchmark.extra_info["bytes"] = 2 * k_cache.numel() * k_cache.element_size()
    benchmark.pedantic(run, rounds=20, warmup_rounds=2)


def tree_vs_flat_blocks(prefix: int = 128, leaf: int = 512, roots: int = 4, branches: int = 2):
    flat = BlockManager(1024, BLOCK)
    for _ in range(roots * branches):
        flat.allocate(leaf)
    tree = BlockManager(1024, BLOCK)
    for _ in range(roots):
        root = tree.allocate(prefix)
        for branch in [root] + [tree.fork(root) for _ in range(branches - 1)]:
            tree.append(branch, leaf - prefix)
    used = lambda m: m.num_blocks - m.num_free_blocks()  # noqa: E731
    return used(flat), used(tree)


def test_tree_kv_blocks(benchmark):
    flat, tree = benchmark.pedantic(tree_vs_flat_blocks, rounds=1)
    benchmark.extra_info["counts"] = dict(flat_blocks=flat, tree_blocks=tree, ratio=tree / flat)
    assert tree < flat
