"""Flat sampling on the engine: generate, GRPO groups (one prefill, G forks), and evaluation."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.rollouts.evaluation import evaluate
from rlvr_fast.rollouts.generation import generate, sample_group
from rlvr_fast.models.checkpoint import load_model
from rlvr_fast.models.policy import load_policy

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [17], [20, 21, 22]]


@pytest.fixture(scope="module")
def engine(hf_qwen3):
    return RolloutEngine(load_model(hf_qwen3[1]), eos_token_ids=[0], kv_blocks=512, block_size=4)


def test_same_generator_seed_reproduces_the_run(engine):
    params = SamplingParams(max_new_tokens=24)
    runs = [
        generate(engine, PROMPTS, params, generator=torch.Generator().manual_seed(seed)).tokens
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_batched_greedy_equals_one_prompt_at_a_time(engine):
    batched = generate(engine, PROMPTS, SamplingParams.greedy(16))
    for prompt, tokens in zip(PROMPTS, batched.tokens):
        assert generate(engine, [prompt], SamplingParams.greedy(16)).tokens[0] == tokens


def test_counts_of_a_batch(engine):
    out = generate(engine, PROMPTS, SamplingParams.greedy(30))
    assert out.counters.prefill_run == sum(map(len, PROMPTS))
    assert out.counters.decode_rows == sum(n - 1 for n in out.lengths)
    assert out.generated_tokens == sum(out.lengths)
    assert engine.blocks_in_use == 0


def test_immediate_eos_costs_no_decode(hf_qwen3):
    model = load_model(hf_qwen3[1])
    first = generate(
        RolloutEngine(model, kv_blocks=64), PROMPTS[:1], SamplingParams.greedy(5)
    ).tokens[0][0]
    out = generate(
        RolloutEngine(model, kv_blocks=64, eos_token_ids=[first]),
        PROMPTS[:1],
        SamplingParams.greedy(5),
    )
    assert out.tokens == [[first]] and out.finish_reasons == ["eos"]
    assert out.counters.decode_rows == 0


def test_empty_prompts_are_refused(engine):
    with pytest.raises(ValueError, match="no prompts"):
        generate(engine, [], SamplingParams())
    with pytest.raises(ValueError, match="needs at least one token"):
        generate(engine, [[1], []], SamplingParams())


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=30), SamplingParams.greedy(30)])
def test_a_group_forked_from_one_prefill_samples_what_g_prefills_sample(engine, params):
    """The GRPO group: prefill tokens executed = |prompt| with forks, G |prompt| without; the
    same tokens either way, and decode work sum(L_i - 1) either way."""
    runs = [
        sample_group(
            engine,
            PROMPTS[2],
            8,
            params,
            reprefill=reprefill,
            generator=torch.Generator().manual_seed(11),
        )
        for reprefill in (False, True)
    ]
    forked, reprefilled = runs
    assert forked.tokens == reprefilled.tokens
    assert forked.counters.prefill_run == len(PROMPTS[2])
    assert reprefilled.counters.prefill_run == 8 * len(PROMPTS[2])
    for out in runs:
        assert out.counters.decode_rows == sum(n - 1 for n in out.lengths)
    assert forked.counters.peak_kv_blocks < reprefilled.counters.peak_kv_blocks
    assert engine.blocks_in_use == 0


def test_continuously_batched_evaluation_grades_what_one_at_a_time_decoding_grades():
    """The whole set at once on an engine with room for 5 rows: the same items as decoding
    each problem alone."""
    policy = load_policy("tiny")
    problems = synthetic_problems("test", 12)
    engine = RolloutEngine.for_policy(policy, max_batch=5, kv_blocks=512)
    together = evaluate(policy, problems, max_new_tokens=48, progress=False, engine=engine)
    alone = [
        evaluate(policy, [p], max_new_tokens=48, progress=False, engine=engine).items[0]
        for p in problems
    ]
    assert together.items == alone
    assert engine.blocks_in_use == 0
