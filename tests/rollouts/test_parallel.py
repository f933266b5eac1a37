"""Parallel-path rollouts, the generative judge, path credit, the parallel ledger laws and the
parallel arms on the embedded model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlvr_fast.data.problems import Problem, render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.rollouts.generation import base_seed, sample_group
from rlvr_fast.credit.judge import GenerativeJudge
from rlvr_fast.ledger.laws import check_conservation
from rlvr_fast.ledger.records import LedgerError, read_record
from rlvr_fast.rollouts.parallel import (
    sample_parallel,
    sample_parallel_batch,
    summarise,
    summary_context,
)
from rlvr_fast.credit.paths import normalise, parallel_credit
from rlvr_fast.models.policy import load_policy
from rlvr_fast.credit.shapley import MajorityVote, PassAtK, shapley_exact
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig

PARAMS = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


@pytest.fixture(scope="module")
def prompt(tiny):
    return tiny.tokenizer.encode(render_prompt("What is 12 + 30?"))


# Planner -----------------------------------------------------------------------------------


def test_paths_are_a_forked_group_with_the_same_streams(tiny, prompt):
    engine = RolloutEngine.shared(tiny)
    out = sample_parallel(
        engine,
        prompt,
        responses=2,
        paths=3,
        params=PARAMS,
        generator=torch.Generator().manual_seed(5),
    )
    group = sample_group(engine, prompt, 6, PARAMS, generator=torch.Generator().manual_seed(5))
    assert out.paths == group.tokens and out.responses == 2
    assert out.response_paths(1) == out.paths[3:]
    assert out.executed.prefill_run == len(prompt)  # the prompt once; six forks
    assert out.executed.decode_rows == sum(len(p) - 1 for p in out.paths)
    assert out.summaries == [] and engine.blocks_in_use == 0


def test_a_batch_of_prompts_samples_each_as_alone_from_its_base(tiny, prompt):
    """Several questions in one engine batch (a multi-question step): each prompt's paths and
    summaries are those ``sample_parallel`` gives it alone from the same base seed, and the
    batch's work is the sum of theirs."""
    engine, tokenizer = RolloutEngine.shared(tiny), tiny.tokenizer
    prompts = [prompt, tokenizer.encode(render_prompt("What is 7 x 8?"))]
    settings = dict(responses=2, paths=2, params=PARAMS, aggregator="summary")
    settings["encode"] = tokenizer.encode
    bases = [base_seed(torch.Generator().manual_seed(seed)) for seed in (3, 4)]
    batch = sample_parallel_batch(engine, prompts, bases, **settings)
    alone = [
        sample_parallel(engine, p, generator=torch.Generator().manual_seed(seed), **settings)
        for p, seed in zip(prompts, (3, 4))
    ]
    for together, single, base in zip(batch, alone, bases):
        assert together.paths == single.paths and together.summaries == single.summaries
        assert together.summary_prompts == single.summary_prompts
        assert together.base == single.base == base
    assert batch[0].executed is batch[1].executed
    for name in ("prefill_run", "decode_rows"):
        assert getattr(batch[0].executed, name) == sum(getattr(a.executed, name) for a in alone)
    assert engine.blocks_in_use == 0


def test_summaries_read_the_serialised_paths_and_reuse_the_prompt(tiny, prompt):
    engine, tokenizer = RolloutEngine.shared(tiny), tiny.tokenizer
    out = sample_parallel(
        engine,
        prompt,
        responses=2,
        paths=2,
        params=PARAMS,
        aggregator="summary",
        encode=tokenizer.encode,
        generator=torch.Generator().manual_seed(9),
    )
    base = base_seed(torch.Generator().manual_seed(9))
    assert out.summary_seeds == [derive_seed(base, 4), derive_seed(base, 5)]
    for r in range(2):
        context = summary_context(out.response_paths(r), tokenizer.encode, tokenizer.eos_token_ids)
        assert out.summary_prompts[r] == prompt + context
        text = tokenizer.decode(context)
        assert text.startswith("\nPath 1:") and "\nPath 2:" in text and text.endswith("\nSummary:")
        assert not set(context) & set(tokenizer.eos_token_ids)
    assert out.executed.prefill_run == len(prompt) + sum(
        len(p) - len(prompt) for p in out.summary_prompts
    )
    assert out.executed.decode_rows == sum(len(x) - 1 for x in out.paths + out.summaries)
    assert engine.blocks_in_use == 0
    # The same seed and context write the same summary (what the diagnostic relies on).
    source = engine.add(prompt)
    again = summarise(
        engine, source, [out.summary_prompts[1][len(prompt) :]], [out.summary_seeds[1]], PARAMS
    )
    engine.free(source)
    assert again[0].completion == out.summaries[1]


def test_planner_errors(tiny, prompt):
    with pytest.raises(ValueError, match="aggregator must be one of"):
        sample_parallel(
            RolloutEngine.shared(tiny),
            prompt,
            responses=1,
            paths=2,
            params=PARAMS,
            aggregator="mean",
        )
    with pytest.raises(ValueError, match="needs encode"):
        sample_parallel(
            RolloutEngine.shared(tiny),
            prompt,
            responses=1,
            paths=2,
            params=PARAMS,
            aggregator="summary",
        )


# Generative judge --------------------------------------------------------------------------

TEXTS = [" 12 + 30 = 42\n\\boxed{42}", " \\boxed{41}", " 2 + 0 = 2, 1 + 3 = 4\n\\boxed{42}"]


def test_judge_batched_equals_one_at_a_time(tiny):
    judge = GenerativeJudge(tiny)
    game = judge.game("What is 12 + 30?", "42", TEXTS)
    masks = np.arange(8)
    engine = RolloutEngine.shared(tiny)
    with engine.measure() as work:
        batched = game.values(masks)
    single = [game.value(int(m)) for m in masks]
    np.testing.assert_allclose(batched, single, atol=1e-5)
    assert ((0 < batched) & (batched < 1)).all()
    # One shared prefix, then only each coalition's own tokens.
    assert work.prefill_run == len(game.prefix_ids) + sum(
        len(game.coalition_ids(int(m))) for m in masks
    )
    assert engine.blocks_in_use == 0
    result = shapley_exact(game, 3)
    assert result.utility_calls == 8
    assert result.phi.sum() == pytest.approx(result.full - result.empty, abs=1e-12)


def test_judge_serialisation(tiny):
    game = GenerativeJudge(tiny).game("What is 12 + 30?", "42", TEXTS)
    decode = tiny.tokenizer.decode
    prompt = decode(game.prefix_ids + game.coalition_ids(0b101))
    assert "Question:\nWhat is 12 + 30?\nReference answer: 42\n" in prompt
    assert f"Path 1:\n{TEXTS[0]}\nPath 2:\n{TEXTS[2]}\nDo these paths" in prompt
    assert TEXTS[1] not in prompt and prompt.endswith("Verdict:")
    assert "No paths.\nDo these paths" in decode(game.prefix_ids + game.coalition_ids(0))


def test_judge_errors(tiny):
    with pytest.raises(ValueError, match="exactly once"):
        GenerativeJudge(tiny, template="no paths here")
    with pytest.raises(ValueError, match="must start with different tokens"):
        GenerativeJudge(tiny, yes=" yes", no=" yeah")


# Path credit -------------------------------------------------------------------------------


def test_normalisations():
    phi = np.array([0.5, 0.5, 0.0, -0.25])
    centred = phi - phi.mean()
    torch.testing.assert_close(normalise(phi, "none"), torch.tensor(phi, dtype=torch.float32))
    torch.testing.assert_close(normalise(phi, "center"), torch.tensor(centred, dtype=torch.float32))
    expected = centred / (np.std(phi, ddof=1) + 1e-4)
    torch.testing.assert_close(
        normalise(phi, "zscore"), torch.tensor(expected, dtype=torch.float32)
    )
    with pytest.raises(ValueError, match="path_reward_norm must be one of"):
        normalise(phi, "softmax")


def test_returns_mix_path_credit_and_outcome():
    votes = [
        MajorityVote(["4", "4", "5"], [True, True, False]),
        MajorityVote(["5", "5", "4"], [False, False, True]),
    ]
    r_out = [votes[0].value(7), votes[1].value(7)]
    assert r_out == [1.0, 0.0]
    credit = parallel_credit(
        votes, r_out, 3, norm="center", lambda_outcome=0.5, lambda_path=0.25, summaries=True
    )
    phi = shapley_exact(votes[0], 3).phi
    np.testing.assert_allclose(credit.path_returns[:3], 0.25 * (phi - phi.mean()) + 0.5, atol=1e-6)
    torch.testing.assert_close(credit.summary_returns, torch.tensor([0.5, 0.0]))
    returns = credit.path_returns
    torch.testing.assert_close(
        credit.path_advantages, (returns - returns.mean()) / (returns.std() + 1e-4)
    )
    assert credit.utility_calls == 16 and credit.tables[0] == votes[0].values(np.arange(8)).tolist()
    paths, summaries = credit.token_weights([2, 1, 3, 1, 1, 1], [4, 2])
    assert [len(w) for w in paths] == [2, 1, 3, 1, 1, 1] and [len(w) for w in summaries] == [4, 2]
    assert not credit.homogeneous


def test_identical_returns_are_homogeneous_and_other_credits_keep_no_table():
    everyone_right = [PassAtK([True, True]), PassAtK([True, True])]
    credit = parallel_credit(everyone_right, [1.0, 1.0], 2)
    assert credit.homogeneous and (credit.path_advantages == 0).all() and credit.sigma == 0
    three = [PassAtK([True, True, False])]  # LOO scores 5 of the 8 coalitions
    loo = parallel_credit(three, [1.0], 3, method="loo")
    assert loo.tables == [None] and loo.phi == [0.0, 0.0, 0.0]
    mc = parallel_credit(
        three, [1.0], 3, permutations=4, generator=torch.Generator().manual_seed(0)
    )
    assert mc.attributions[0].permutations == 4 and mc.phi == [0.5, 0.5, 0.0]


# The arms on the embedded model, and the ledger's parallel laws ----------------------------

FAST = dict(
    max_new_tokens=32,
    eval_max_new_tokens=32,
    lr=1e-4,
    group_size=2,
    num_paths=3,
    gate_min_chars=None,
)
EASY = Problem(id="easy", question="What is 12 * 3?", answer="36", source="test")


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def summary_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary_run")
    config = TrainConfig.from_arm("shapley_summary", steps=2, **FAST)
    RLVRTrainer(load_policy("tiny"), config, [EASY], out_dir=out, progress=False).train()
    return out


def test_summary_arm_ledger_and_rollouts(summary_run):
    lines = read_lines(summary_run / "ledger.jsonl")
    for line in lines:
        check_conservation(read_record(line))
        stats = line["parallel"]
        assert len(stats["summary_lengths"]) == 2 and len(stats["phi"]) == 6
        assert stats["utility_calls"] == 2 * 8  # exact: R 2^K
        assert line["gen"] == line["leaf"] + sum(stats["summary_lengths"])
        assert "shapley" in line["seconds"]
    rollout = read_lines(summary_run / "rollouts.jsonl")[0]["parallel"]
    assert len(rollout["path_ids"]) == 6 and len(rollout["summary_seeds"]) == 2
    assert len(rollout["utility_tables"][0]) == 8 and rollout["gold"] == "36"


def shift_rewards(line: dict, by: float) -> None:
    """Every path's reward moved alike (tuples included), so only the reward law breaks."""
    line["rewards"] = [r + by for r in line["rewards"]]
    for pair in line["pairs"]:
        pair[4] += by
        pair[5] += by


@pytest.mark.parametrize(
    "mutate,law",
    [
        (
            lambda s: s["parallel"]["phi"].__setitem__(0, s["parallel"]["phi"][0] + 0.5),
            "efficiency",
        ),
        (lambda s: shift_rewards(s, 0.1), "path reward"),
        (lambda s: s["parallel"]["summary_lengths"].pop(), "one summary per response"),
        (lambda s: s["parallel"].__setitem__("utility_calls", 7), "exact Shapley scores all"),
        (
            lambda s: s["parallel"].__setitem__(
                "summary_rewards", [r + 9.0 for r in s["parallel"]["summary_rewards"]]
            ),
            "summary reward",
        ),
        (lambda s: s.__setitem__("pref", s["pref"] + 1), "pref = R K L_p"),
    ],
)
def test_the_parallel_laws_catch_a_broken_line(summary_run, mutate, law):
    line = read_lines(summary_run / "ledger.jsonl")[0]
    mutate(line)
    with pytest.raises(LedgerError, match=law):
        check_conservation(read_record(line))


def test_judge_utility_with_monte_carlo_credit(tiny, tmp_path):
    config = TrainConfig.from_arm(
        "shapley_vote", steps=1, path_utility="judge", shapley_permutations=4, **FAST
    )
    trainer = RLVRTrainer(tiny, config, [EASY], out_dir=tmp_path, progress=False)
    trainer.train()
    line = read_lines(tmp_path / "ledger.jsonl")[0]
    check_conservation(read_record(line))
    stats = line["parallel"]
    assert stats["path_utility"] == "judge" and stats["permutations"] == 4
    assert all(se >= 0 for se in stats["phi_se"]) and 2 <= stats["utility_calls"] <= 16
    for r in range(2):
        assert 0 < stats["utility_full"][r] < 1


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(aggregator="poll"), "aggregator must be one of"),
        (dict(path_utility="grm"), "path_utility must be one of"),
        (dict(path_credit="banzhaf"), "path_credit must be one of"),
        (dict(num_paths=20), "exact Shapley takes at most 16"),
        (dict(shapley_permutations=5), "even shapley_permutations"),
        (dict(shapley_permutations=1, shapley_antithetic=False), "shapley_permutations >= 2"),
        (dict(lambda_path=-1.0), "lambda_outcome and lambda_path"),
        (dict(loss_order="sum_then_scale"), "need loss_order token_weighted"),
    ],
)
def test_bad_parallel_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_arm("shapley_vote", **settings)


def test_parallel_arms_learn_on_an_easy_question(tiny):
    """A step whose paths disagree moves the weights: the credit reaches the loss (3-digit
    sums, which the tiny model gets right about a third of the time)."""
    problems = synthetic_problems("train", 4, seed=11, levels=(1,))
    config = TrainConfig.from_arm("shapley_vote", steps=4, **dict(FAST, max_new_tokens=128))
    trainer = RLVRTrainer(load_policy("tiny"), config, problems, progress=False)
    records = [trainer.step_on(i, [p]).record for i, p in enumerate(problems)]
    active = [r for r in records if r["active"]]
    assert active, "no step had a nonzero advantage"
    assert all(r["loss"] is not None and r["grad_norm"] > 0 for r in active)
