"""Paged vs contiguous KV cache: decode throughput, and KV blocks for a K=4 x B=2 tree.

Decode: the tiny model, 8 copies of one prompt, 128 sampled tokens per row with EOS off, on the
contiguous cache (the reference) and the paged cache (16-token blocks). Memory: blocks held by
8 flat rows vs 4 roots forked twice at a 128-token prefix, every leaf at the same final length.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast._C import BlockManager
from rlvr_fast.data import render_prompt, synthetic_problems
from rlvr_fast.engine.sampler import SamplingParams, generate
from rlvr_fast.policy import load_policy

BATCH, NEW_TOKENS, BLOCK = 8, 128, 16


@pytest.fixture(scope="module")
def prompt_ids():
    policy = load_policy("tiny", device="cuda" if torch.cuda.is_available() else "cpu")
    question = synthetic_problems("test", 1)[0].question
    return policy, [policy.tokenizer.encode(render_prompt(question))] * BATCH


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_decode_paged_vs_contiguous(benchmark, prompt_ids, role):
    policy, prompts = prompt_ids
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    generator = torch.Generator(device=policy.device).manual_seed(0)

    def run():
        out = generate(policy.model, prompts, params, eos_token_ids=[], generator=generator,
                       paged=role == "fast", block_size=BLOCK)
        assert out.generated_tokens == BATCH * NEW_TOKENS

    mark(benchmark, "decode paged (fast) vs contiguous (eager)", role,
         work=BATCH * NEW_TOKENS, unit="tokens")
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)


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
