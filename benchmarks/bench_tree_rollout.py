"""Tree rollout step: Stage 2 forked on the paged cache (fast) vs re-prefilled (the seed's way,
eager), beside 8 flat rollouts, on the same model and generator.

The tiny model, one synthetic prompt, K=4 x B=2, every root split at exactly 128 tokens and
every leaf run to the 512-token cap (EOS off), so all three do fixed work: the flat batch 8 x 512
sampled tokens, each tree 4 x 128 + 8 x 384. Besides wall-clock, each run records prefill tokens
(Stage 1 and Stage 2), decode rows, block copies and peak KV blocks, which the summary prints
after the timings, so a GPU run (``benchmarks/gpu/check.sh``) reports the same table.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.data import render_prompt, synthetic_problems
from rlvr_fast.engine.sampler import SamplingParams, generate
from rlvr_fast.policy import load_policy
from rlvr_fast.rollout import sample_tree_ids

K, B, SPLIT, CAP, BLOCK = 4, 2, 128, 512, 16


@pytest.fixture(scope="module")
def setup():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_policy("tiny", device=device)
    prompt = policy.tokenizer.encode(render_prompt(synthetic_problems("test", 1)[0].question))
    return policy, prompt


def report(benchmark, **counts) -> None:
    """Counts for the summary the benchmark conftest prints after the timings."""
    benchmark.extra_info["counts"] = counts


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_tree_step_fork_vs_reprefill(benchmark, setup, role):
    policy, prompt = setup
    generator = torch.Generator(device=policy.device)

    def run():
        generator.manual_seed(0)
        return sample_tree_ids(policy.model, prompt, eos_token_ids=[], newline_token_ids=[],
                               k=K, b=B, t_min=SPLIT, t_max=SPLIT, max_new_tokens=CAP,
                               generator=generator, reprefill=role == "eager", block_size=BLOCK)

    mark(benchmark, "tree step: fork (fast) vs re-prefill (eager)", role,
         work=K * SPLIT + K * B * (CAP - SPLIT), unit="tokens")
    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert out.lengths == [CAP] * (K * B)
    assert role == "eager" or out.stage2_prefill_tokens == 0
    report(benchmark, stage1_prefill=out.stage1_prefill_tokens, stage2_prefill=out.stage2_prefill_tokens,
           decode_rows=out.decode_rows, block_copies=out.block_copies,
           peak_kv_blocks=out.peak_kv_blocks)


def test_flat_eight_rollouts(benchmark, setup):
    policy, prompt = setup
    generator = torch.Generator(device=policy.device)

    def run():
        generator.manual_seed(0)
        return generate(policy.model, [prompt] * (K * B), SamplingParams(max_new_tokens=CAP),
                        eos_token_ids=[], generator=generator, paged=True, block_size=BLOCK)

    benchmark.group = "tree step: fork (fast) vs re-prefill (eager)"
    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    report(benchmark, prefill=out.prefill_tokens,
           decode_rows=out.decode_tokens, peak_kv_blocks=out.peak_kv_blocks)
