"""Multi-turn rollouts on the engine (``rollouts.turns.sample_turns``): appended turns extend the
live sequence, so a round's prefill is the appended tokens, never the conversation again; the
turns sampled after an appended one are those of a fresh sequence prefilled with the whole
conversation; masks, caps and blocks."""

from __future__ import annotations

import pytest

from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.models.checkpoint import load_model
from rlvr_fast.rollouts.generation import sample_groups
from rlvr_fast.rollouts.turns import sample_turns

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 12]]
TOOL_TURN = [30, 31, 32, 33]
BASES = [11, 12]


@pytest.fixture(scope="module")
def engine(hf_qwen3):
    return RolloutEngine(load_model(hf_qwen3[1]), eos_token_ids=[0], kv_blocks=512, block_size=4)


def always_a_tool_turn(row, completion):
    return list(TOOL_TURN)


def test_appended_turns_prefill_only_their_tokens(engine):
    out = sample_turns(
        engine, PROMPTS, 3, SamplingParams(6), always_a_tool_turn, max_rounds=2,
        max_completion_tokens=64, bases=BASES,
    )  # fmt: skip
    assert all(len(t) == 5 for t in out.turns), "three sampled turns, two appended"
    rounds = sum(len(t) // 2 for t in out.turns)
    # Each prompt once, then per appended turn its tokens and the turn's last sampled token.
    assert out.counters.prefill_run == sum(map(len, PROMPTS)) + rounds * (len(TOOL_TURN) + 1)
    assert engine.blocks_in_use == 0
    # The first turn is sample_groups' own.
    first = sample_groups(engine, PROMPTS, 3, SamplingParams(6), bases=BASES)
    for tokens, turns, alone in zip(out.tokens, out.turns, first.tokens):
        assert tokens[: turns[0]] == alone
    for tokens, mask, turns in zip(out.tokens, out.masks, out.turns):
        assert len(mask) == len(tokens) == sum(turns)
        cut = turns[0] + turns[1]
        assert tokens[turns[0] : cut] == TOOL_TURN and mask[turns[0] : cut] == [0] * 4
        assert mask[: turns[0]] == [1] * turns[0] and mask[cut : cut + turns[2]] == [1] * turns[2]


def test_a_turn_after_an_appended_one_is_what_a_fresh_prefill_samples(engine):
    """Row i's last turn equals what a new sequence of the whole conversation so far samples
    from the same stream (its positions are the same): the kept cache holds what a prefill of
    the conversation would."""
    out = sample_turns(
        engine, PROMPTS, 2, SamplingParams(5), always_a_tool_turn, max_rounds=2,
        max_completion_tokens=64, bases=BASES,
    )  # fmt: skip
    for row, (tokens, turns) in enumerate(zip(out.tokens, out.turns)):
        prompt = PROMPTS[row // 2]
        before = len(tokens) - turns[-1]
        fresh = engine.add(prompt + tokens[:before], seed=derive_seed(BASES[row // 2], row % 2))
        engine.run([fresh], SamplingParams(turns[-1]))
        assert fresh.completion == tokens[before:]


def test_the_completion_cap_covers_every_turn(engine):
    def fits(row, completion):
        return list(TOOL_TURN) if len(completion) + len(TOOL_TURN) <= 12 else None

    out = sample_turns(
        engine, PROMPTS, 2, SamplingParams(5), fits, max_rounds=5,
        max_completion_tokens=12, bases=BASES,
    )  # fmt: skip
    for tokens, turns in zip(out.tokens, out.turns):
        assert len(tokens) == sum(turns) <= 12
        assert all(count <= 5 for count in turns[::2])
    # 5 sampled (the turn's cap), 4 appended: the completion's cap of 9 leaves none to sample.
    filled = sample_turns(
        engine, PROMPTS[:1], 1, SamplingParams(5), always_a_tool_turn, max_rounds=5,
        max_completion_tokens=9, bases=[3],
    )  # fmt: skip
    assert filled.turns == [[5, 4, 0]]
    with pytest.raises(ValueError, match="passes the completion cap of 3 tokens"):
        sample_turns(
            engine, PROMPTS[:1], 1, SamplingParams(64), always_a_tool_turn, max_rounds=1,
            max_completion_tokens=3, bases=[3],
        )  # fmt: skip
    assert engine.blocks_in_use == 0
