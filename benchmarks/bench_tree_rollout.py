"""Tree rollout step: Stage 2 forked on the paged cache (fast) vs re-prefilled (the seed's way,
eager), beside 8 flat rollouts, on the same model and generator.

The tiny model on one rollout engine, one synthetic prompt, K=4 x B=2, every root split at
exactly 128 tokens and every leaf run to the 512-token cap (EOS off), so all three do fixed work:
the flat group 8 x 512 sampled tokens (its prompt prefilled once and forked), each tree
4 x 128 + 8 x 384. Besides wall-clock, each run records prefill tokens
(Stage 1 and Stage 2), decode rows, block copies and peak KV blocks, which the summary prints
after the timings, so a GPU run (``benchmarks/gpu/check.sh``) reports the same table.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.rollouts.generation import sample_group
from rlvr_fast.models.policy import load_policy
from rlvr_fast.rollouts.trees import sample_tree_ids

K, B, SPLIT, CAP = 4, 2, 128, 512


@pytest.fixture(scope="module")
def setup():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_policy("tiny", device=device)
    prompt = policy.tokenizer.encode(render_prompt(synthetic_problems("test", 1)[0].question))
    # EOS off: every root is cut at SPLIT and every leaf runs to the cap.
    return RolloutEngine(policy.model, kv_blocks=1024), prompt


def report(benchmark, **counts) -> None:
    """Counts for the summary the benchmark conftest prints after the timings."""
    benchmark.extra_info["counts"] = counts


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_tree_step_fork_vs_reprefill(benchmark, setup, role):
    engine, prompt = setup

    def run():
        return sample_tree_ids(
            engine,
            prompt,
            newline_token_ids=[],
            k=K,
            b=B,
            t_min=SPLIT,
            t_max=SPLIT,
            max_new_tokens=CAP,
            generator=torch.Generator().manual_seed(0),
            reprefill=role == "eager",
        )

    mark(
        benchmark,
        "tree step: fork (fast) vs re-prefill (eager)",
        role,
        work=K * SPLIT + K * B * (CAP - SPLIT),
        unit="tokens",
    )
    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert out.lengths == [CAP] * (K * B)
    assert role == "eager" or out.stage2.prefill_run == 0
    report(
        benchmark,
        stage1_prefill=out.stage1.prefill_run,
        stage2_prefill=out.stage2.prefill_run,
        decode_rows=out.executed.decode_rows,
        block_copies=out.executed.block_copies,
        peak_kv_blocks=out.executed.peak_kv_blocks,
    )


def test_flat_eight_rollouts(benchmark, setup):
    engine, prompt = setup

    def run():
        return sample_group(
            engine,
            prompt,
            K * B,
            SamplingParams(max_new_tokens=CAP),
            generator=torch.Generator().manual_seed(0),
        )

    benchmark.group = "tree step: fork (fast) vs re-prefill (eager)"
    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    report(
        benchmark,
        prefill=out.counters.prefill_run,
        decode_rows=out.counters.decode_rows,
        peak_kv_blocks=out.counters.peak_kv_blocks,
    )
