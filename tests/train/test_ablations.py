"""The study's Table 3 ablations: multi-question steps with unit-normalised accumulation (batched
sampling, the hand computation, the zero-gradient rule, the ledger and verify), the Polyak tail
(the hand average, across a resume), and --active-steps."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.data.problems import Problem
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.rollouts.generation import sample_group, sample_groups
from rlvr_fast.models.checkpoint import load_model
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.polyak import DEVICE_RESERVE_BYTES, PolyakAverage, sums_fit, trainable
from rlvr_fast.rollouts.trees import sample_tree_ids, sample_trees_ids
from rlvr_fast.run.state_file import load_state
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.utils.phases import Phases
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.losses import fused_grpo_loss
from killed_runs import kill_during_step

FAST = dict(max_new_tokens=48, eval_max_new_tokens=48, lr=1e-4)
IMPOSSIBLE = [
    Problem(id=f"impossible-{i}", question=f"What is {i} + 30?", answer="-1", source="test")
    for i in range(2)
]


@pytest.fixture()
def tiny():
    return load_policy("tiny")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------- batched sampling
def test_groups_sampled_in_one_batch_equal_groups_sampled_one_by_one(tiny):
    engine = RolloutEngine.for_policy(tiny, kv_blocks=256)
    prompts = [tiny.tokenizer.encode(p.question) for p in synthetic_problems("train", 3, seed=5)]
    params = SamplingParams(max_new_tokens=24)
    batched = sample_groups(engine, prompts, 4, params, generator=torch.Generator().manual_seed(9))
    generator = torch.Generator().manual_seed(9)
    alone = [sample_group(engine, prompt, 4, params, generator=generator) for prompt in prompts]
    assert batched.tokens == [tokens for out in alone for tokens in out.tokens]
    assert batched.counters.prefill_run == sum(map(len, prompts)), "each prompt once, then forks"
    assert batched.counters.decode_rows == sum(n - 1 for n in batched.lengths)
    assert engine.blocks_in_use == 0


def test_trees_sampled_in_one_batch_equal_trees_sampled_one_by_one(tiny):
    engine = RolloutEngine.for_policy(tiny, kv_blocks=256)
    prompts = [tiny.tokenizer.encode(p.question) for p in synthetic_problems("train", 3, seed=6)]
    settings = dict(
        newline_token_ids=tiny.tokenizer.newline_token_ids, t_min=4, t_max=8, max_new_tokens=32
    )
    batched = sample_trees_ids(
        engine, prompts, generator=torch.Generator().manual_seed(3), **settings
    )
    generator = torch.Generator().manual_seed(3)
    alone = [sample_tree_ids(engine, prompt, generator=generator, **settings) for prompt in prompts]
    for together, single in zip(batched, alone):
        assert together.pairs == single.pairs
        assert together.stage2_generated == single.stage2_generated
    assert batched[0].executed.prefill_run == sum(map(len, prompts))
    assert engine.blocks_in_use == 0


# ---------------------------------------------------------------------------- accumulation
def test_unit_normalised_accumulation_equals_the_hand_computation_on_two_questions(tiny):
    config = TrainConfig.from_arm("ra_flat", questions_per_step=2, max_grad_norm=None, **FAST)
    trainer = RLVRTrainer(tiny, config, IMPOSSIBLE, progress=False)
    model = tiny.model
    questions = [
        (
            [5, 6, 7],
            [[8, 9, 10], [11, 12]],
            [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([-0.5, -0.5])],
        ),
        (
            [3, 4],
            [[13], [14, 15, 16, 17]],
            [torch.tensor([2.0]), torch.tensor([-1.0, -1.0, -1.0, -1.0])],
        ),
    ]
    hand, losses = [], []
    for prompt, completions, weights in questions:
        model.zero_grad(set_to_none=True)
        loss = fused_grpo_loss(model, prompt, completions, weights)
        loss.backward()
        hand.append([p.grad.clone() for p in trainer.stepping.params])
        losses.append(float(loss.detach()))
    model.zero_grad(set_to_none=True)
    norms = [
        float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) for grads in hand
    ]
    expected = [(a / norms[0] + b / norms[1]) / 2 for a, b in zip(*hand)]

    update = trainer.stepping.accumulate_unit_gradients(
        Phases(tiny.device), [lambda q=q: fused_grpo_loss(model, *q) for q in questions], 2
    )
    for p, want in zip(trainer.stepping.params, expected):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)
    assert update.question_grad_norms == pytest.approx(norms, rel=1e-5)
    assert update.question_losses == pytest.approx(losses, rel=1e-5)
    assert update.loss == pytest.approx((losses[0] / norms[0] + losses[1] / norms[1]) / 2, rel=1e-5)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.stepping.params]))
    assert float(total) <= 1 + 1e-6, "an average of unit vectors: clipping at 1 never binds"


def test_a_step_whose_questions_are_all_homogeneous_is_a_zero_gradient_step(tiny):
    config = TrainConfig.from_arm("ra_flat", questions_per_step=2, **FAST)
    trainer = RLVRTrainer(tiny, config, IMPOSSIBLE, progress=False)
    before = [p.detach().clone() for p in trainer.stepping.params]
    record = trainer.run_step(0).record
    assert record["homogeneous"] and not record["active"] and record["optimizer_step"]
    assert record["zero_var_questions"] == 2 and record["loss"] is None
    assert [q["question_id"] for q in record["questions"]] == ["impossible-0", "impossible-1"]
    assert record["bwd_out"] == record["bwd_full"] == 0
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {1}
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.stepping.params)), (
        "weight decay"
    )


def test_multi_question_run_batches_its_questions_and_verify_rederives_it(tiny, tmp_path):
    problems = synthetic_problems("train", 6, seed=11)
    config = TrainConfig.from_arm(
        "ra_flat", steps=3, questions_per_step=2, gate_min_chars=None, **FAST
    )
    RLVRTrainer(tiny, config, problems, out_dir=tmp_path, progress=False).train()
    lines = read_jsonl(tmp_path / "ledger.jsonl")
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [[q["question_id"] for q in line["questions"]] for line in lines] == [
        [p.id for p in problems[i : i + 2]] for i in (0, 2, 4)
    ]
    for line, rollout in zip(lines, rollouts):
        # One batch: each prompt prefilled once, the rest forks; the engine's count is the step's.
        assert line["prefill_run"] == sum(q["prompt_len"] for q in line["questions"])
        assert all(q["prefill_run"] == 0 for q in line["questions"])
        contributing = [q for q in line["questions"] if q["active"]]
        assert line["zero_var_questions"] == len(line["questions"]) - len(contributing)
        assert all(q["grad_norm"] > 0 for q in contributing)
        assert [q["texts"] for q in rollout["questions"]] and rollout["step"] == line["step"]
    assert verify_run(tmp_path).ok

    lines[1]["questions"][1]["gen"] += 1
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    failures = [f for check in verify_run(tmp_path).checks for f in check.failures]
    assert "step 1 questions[1].gen: recorded" in "\n".join(failures)


def test_multi_question_settings_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="needs skip_zero_var"):
        TrainConfig.from_arm("baseline", questions_per_step=2)
    with pytest.raises(ValueError, match="zero_cont_mass centres tree continuations"):
        TrainConfig.from_arm("ra_flat", zero_cont_mass=True)
    with pytest.raises(ValueError, match=r"questions_per_step must be in \[1, 1024\]"):
        TrainConfig.from_arm("accum4", questions_per_step=0)


# ---------------------------------------------------------------------------- Polyak tail
def polyak_trainer(out_dir, problems, resume=False):
    config = TrainConfig.from_arm("zg_flat", steps=5, polyak_start=2, checkpoint_every=2, **FAST)
    return RLVRTrainer(
        load_policy("tiny"),
        config,
        problems,
        {"held_out": synthetic_problems("test", 4, seed=1)},
        out_dir=out_dir,
        resume=resume,
        progress=False,
    )


def test_polyak_average_equals_the_hand_average_also_across_a_resume(tmp_path):
    problems = synthetic_problems("train", 5, seed=3)
    whole = polyak_trainer(tmp_path / "whole", problems)
    snapshots = []
    run_step = whole.run_step

    def snapshot_after(step):
        result = run_step(step)
        snapshots.append({n: p.detach().clone() for n, p in trainable(whole.policy.model).items()})
        return result

    whole.run_step = snapshot_after
    summary = whole.train()
    assert summary["polyak"] == {"first_step": 2, "steps_averaged": 4}
    # Steps 2..5 counted from 1: the weights after the last four steps, summed in float32.
    hand = {}
    for name in snapshots[0]:
        total = torch.zeros_like(snapshots[0][name], dtype=torch.float32)
        for snapshot in snapshots[1:]:
            total += snapshot[name]
        hand[name] = total / 4
    averaged = dict(load_model(tmp_path / "whole" / "final_polyak").named_parameters())
    for name, want in hand.items():
        assert torch.equal(averaged[name], want), name
    live = dict(load_model(tmp_path / "whole" / "final").named_parameters())
    for name, param in trainable(whole.policy.model).items():
        assert torch.equal(param, snapshots[-1][name]) and torch.equal(live[name], param)
    assert set(summary["eval_polyak"]) == {"held_out"}
    assert (tmp_path / "whole" / "evals" / "polyak" / "held_out.jsonl").is_file()
    assert verify_run(tmp_path / "whole").ok

    interrupted = polyak_trainer(tmp_path / "resumed", problems)
    kill_during_step(interrupted, 3)
    resumed = polyak_trainer(tmp_path / "resumed", problems, resume=True)
    assert resumed.start_step == 2 and resumed.polyak.count == 1
    resumed.train()
    again = dict(load_model(tmp_path / "resumed" / "final_polyak").named_parameters())
    for name, want in hand.items():
        assert torch.equal(again[name], want), name


def test_polyak_sums_and_state_round_trip():
    model = torch.nn.Linear(3, 2)
    polyak = PolyakAverage(model)
    with pytest.raises(ValueError, match="no steps were averaged"):
        polyak.average()
    weights = []
    for value in (1.0, 2.0, 4.5):
        with torch.no_grad():
            model.weight.fill_(value)
        polyak.add(model)
        weights.append(value)
    assert torch.equal(polyak.average()["weight"], torch.full((2, 3), sum(weights) / 3))
    restored = PolyakAverage(model, device="cpu")
    restored.load_state_dict(polyak.state_dict())
    assert restored.count == 3 and torch.equal(restored.average()["bias"], polyak.average()["bias"])
    with pytest.raises(ValueError, match="averaged parameters differ"):
        PolyakAverage(torch.nn.Linear(3, 3, bias=False)).load_state_dict(polyak.state_dict())


def test_polyak_sums_leave_a_short_device_for_the_cpu():
    params = 751_632_384  # Qwen3-0.6B-Base untied: 3.0 GB of FP32 sums
    assert sums_fit(4 * params + DEVICE_RESERVE_BYTES, params)
    assert not sums_fit(4 * params + DEVICE_RESERVE_BYTES - 1, params)
    assert PolyakAverage(torch.nn.Linear(2, 2)).device == torch.device("cpu")


def test_polyak_start_after_the_last_step_is_refused():
    with pytest.raises(ValueError, match=r"polyak_start must be in \[0, steps = 10\]"):
        TrainConfig.from_arm("ra_mst_tail50", steps=10)


# ---------------------------------------------------------------------------- active steps
def test_active_steps_stop_on_the_step_that_reaches_them(tiny, tmp_path):
    # With these problems, steps 1 and 4 of 8 are active: the run stops after step 4.
    problems = synthetic_problems("train", 8, seed=4)
    config = TrainConfig.from_arm("zg_flat", steps=8, active_steps=2, **FAST)
    summary = RLVRTrainer(tiny, config, problems, out_dir=tmp_path, progress=False).train()
    lines = read_jsonl(tmp_path / "ledger.jsonl")
    active = [line["active"] for line in lines]
    assert sum(active) == 2 and active[-1], "the run ends on its second active step"
    assert summary["steps"] == len(lines) == 5
    assert load_state(RunLayout(tmp_path).checkpoint)["next_step"] == len(lines)
    assert verify_run(tmp_path).ok
    with pytest.raises(ValueError, match=r"active_steps must be in \[1, steps = 8\]"):
        TrainConfig.from_arm("zg_flat", steps=8, active_steps=9)
