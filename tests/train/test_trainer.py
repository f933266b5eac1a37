"""GRPO trainer: loss, advantages, arm semantics, ledger conservation, resume, config errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.train.arms import ARMS
from rlvr_fast.data.problems import Problem
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.grading import passes_gate
from rlvr_fast.ledger.laws import check_conservation
from rlvr_fast.ledger.records import MultiQuestionRecord, read_record
from rlvr_fast.models.checkpoint import load_model
from rlvr_fast.models.policy import Policy, load_policy
from rlvr_fast.run.directory import RunDirectoryError
from rlvr_fast.run.state_file import load_state, read_state
from rlvr_fast.run import checkpoint
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.utils.phases import Phases
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.losses import completion_token_nll, fused_grpo_loss, grpo_loss, study_loss
from rlvr_fast.ops.loss_types import loss_type
from rlvr_fast.credit.group import standardised_advantages
from killed_runs import kill_during_step

FAST = dict(max_new_tokens=64, eval_max_new_tokens=64, lr=1e-4)
# Tree arms on the tiny model: split at the first newline after 8 tokens, trees from step 0.
TREE_FAST = dict(FAST, t_min=8, t_max=16, bifurcate_after_active=0)
TREE_ARMS = [name for name, settings in ARMS.items() if settings.get("sampler") == "tree"]


def fast_settings(arm: str) -> dict:
    settings = TREE_FAST if arm in TREE_ARMS else FAST
    # A Polyak window that starts inside a three-step run.
    return dict(settings, polyak_start=2) if ARMS[arm].get("polyak_start") else settings


IMPOSSIBLE = Problem(id="impossible", question="What is 12 + 30?", answer="-1", source="test")


def test_advantages_use_the_seeds_unbiased_std():
    advantages, sigma = standardised_advantages([1.0, 1.0, 0.0, 0.0])
    assert sigma == pytest.approx(0.57735, rel=1e-5)
    assert advantages.tolist() == pytest.approx([0.8659, 0.8659, -0.8659, -0.8659], abs=1e-4)
    zeros, sigma = standardised_advantages([1.0] * 8)
    assert sigma == 0 and torch.equal(zeros, torch.zeros(8))


def test_loss_equals_hand_computed_grpo_loss(hf_qwen3):
    model = load_model(hf_qwen3[1])
    prompt, completions = [5, 6, 7], [[8, 9, 10, 0], [11], [12, 13], [14, 15, 16, 17, 18]]
    advantages = torch.tensor([0.5, -1.5, 2.0, -1.0])
    token_nll = completion_token_nll(model, prompt, completions)
    expected = torch.zeros(())
    with torch.no_grad():
        for a, completion in zip(advantages, completions):
            seq = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(seq)[0, len(prompt) - 1 : -1].double(), -1)
            expected += -a * logp[torch.arange(len(completion)), torch.tensor(completion)].sum()
    expected /= len(completions)
    for order in ("sum_then_scale", "token_weighted"):
        loss = grpo_loss(token_nll, advantages, order)
        assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert (token_nll[1, 1:] == 0).all(), "padding positions carry no loss"
    fused = fused_grpo_loss(
        model, prompt, completions, [a.expand(len(c)) for a, c in zip(advantages, completions)]
    )
    assert float(fused.detach()) == pytest.approx(float(expected), rel=1e-5)
    fused.backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    grpo_loss(
        completion_token_nll(model, prompt, completions), advantages, "token_weighted"
    ).backward()
    # atol 5e-6: the fused dW sums its chunks' fp32 products in another order than eager's one
    # GEMM, and the GEMM's own order changes with the thread count (1e-6 held at two threads).
    for fused_grad, p in zip(fused_grads, model.parameters()):
        torch.testing.assert_close(fused_grad, p.grad, rtol=1e-4, atol=5e-6)


def test_the_sum_then_scale_study_loss_matches_the_eager_one(hf_qwen3):
    model = load_model(hf_qwen3[1])
    prompt, completions = [5, 6, 7], [[8, 9, 10, 0], [11], [12, 13], [14, 15, 16, 17, 18]]
    advantages = torch.tensor([0.5, -1.5, 2.0, -1.0])
    losses, grads = [], []
    for loss_fn in (
        lambda: grpo_loss(
            completion_token_nll(model, prompt, completions), advantages, "sum_then_scale"
        ),
        lambda: study_loss(
            model, prompt, completions, loss_type("sum", order="sum_then_scale"), advantages, None
        ),
    ):
        model.zero_grad()
        loss = loss_fn()
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for fused_grad, eager_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-4, atol=5e-6)  # as above


@pytest.fixture()
def tiny():
    return load_policy("tiny")


def homogeneous_step(tiny, arm):
    trainer = RLVRTrainer(tiny, TrainConfig.from_arm(arm, **FAST), [IMPOSSIBLE], progress=False)
    before = [p.detach().clone() for p in trainer.stepping.params]
    record = trainer.step_on(0, [IMPOSSIBLE]).record
    changed = any(not torch.equal(a, p) for a, p in zip(before, trainer.stepping.params))
    steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    return record, changed, steps


@pytest.mark.parametrize(
    "arm,advances",
    [("zg_flat", True), ("ra_flat", True), ("gate_flat", False), ("skip_zero_var", False)],
)
def test_homogeneous_groups_skip_backward(tiny, arm, advances):
    record, changed, steps = homogeneous_step(tiny, arm)
    assert record["homogeneous"] and not record["active"]
    assert record["bwd_out"] == record["bwd_full"] == 0 and record["loss"] is None
    assert record["optimizer_step"] is advances
    # A zero-gradient AdamW step still counts a step and applies weight decay.
    assert changed is advances
    assert steps == ({1} if advances else set())


def test_baseline_runs_backward_on_homogeneous_groups(tiny):
    record, changed, steps = homogeneous_step(tiny, "baseline")
    assert record["active"] and record["loss"] == 0.0
    assert record["bwd_out"] == record["leaf"] > 0
    assert steps == {1} and changed


def read_ledger(run_dir):
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arm", list(ARMS))
def test_three_step_run_keeps_the_ledger_conserved(tiny, tmp_path, arm):
    problems = synthetic_problems("train", 3, seed=11)
    trainer = RLVRTrainer(
        tiny,
        TrainConfig.from_arm(arm, steps=3, **fast_settings(arm)),
        problems,
        out_dir=tmp_path,
        progress=False,
    )
    summary = trainer.train()
    lines = read_ledger(tmp_path)
    assert [line["step"] for line in lines] == [0, 1, 2]
    questions_per_step = ARMS[arm].get("questions_per_step", 1)
    for line in lines:
        record = read_record(line)
        check_conservation(record)
        assert isinstance(record, MultiQuestionRecord) == (questions_per_step > 1)
        params = line["params"]
        assert line["flops_out"] == (2 * line["gen"] + 6 * line["bwd_out"]) * params
        assert (
            line["flops_full"] == (2 * (line["pref"] + line["gen"]) + 6 * line["bwd_full"]) * params
        )
        assert (
            line["flops_pad_full"]
            == (2 * (line["pad_pref"] + line["untrim_gen"]) + 6 * line["bwd_full"]) * params
        )
    assert summary["totals_this_run"]["bwd_out"] == sum(line["bwd_out"] for line in lines)
    if ARMS[arm]["gate_min_chars"]:
        rollouts = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
        for step in rollouts:
            for question in step.get("questions", [step]):
                for text, reward in zip(question["texts"], question["rewards"]):
                    assert not reward or passes_gate(text)
    assert (tmp_path / "final" / "model.safetensors").is_file()
    if ARMS[arm].get("polyak_start"):
        assert (tmp_path / "final_polyak" / "model.safetensors").is_file()
    verification = verify_run(tmp_path)
    assert verification.ok, "\n".join(verification.lines())


def test_per_token_weights_reach_the_loss(hf_qwen3):
    """Tree steps weight prefix and continuation tokens differently: the fused loss must equal
    -(1/G) sum_i sum_t w_it log pi(y_t) for arbitrary per-token weights."""
    model = load_model(hf_qwen3[1])
    prompt, completions = [5, 6], [[8, 9, 10], [8, 9, 11, 12], [7]]
    weights = [
        torch.tensor([0.5, 0.5, -1.0]),
        torch.tensor([0.5, 0.5, 2.0, 2.0]),
        torch.tensor([-0.25]),
    ]
    expected = 0.0
    with torch.no_grad():
        for w, completion in zip(weights, completions):
            logp = torch.log_softmax(model(torch.tensor([prompt + completion]))[0].double(), -1)
            picked = logp[
                torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1),
                torch.tensor(completion),
            ]
            expected -= float((w.double() * picked).sum())
    loss = fused_grpo_loss(model, prompt, completions, weights)
    assert float(loss.detach()) == pytest.approx(expected / len(completions), rel=1e-5)


def test_tree_arms_bifurcate_after_the_warmup_active_steps(tiny, tmp_path):
    """Flat warmup steps until ``bifurcate_after_active`` steps ran a backward pass, then trees
    whose ledger lines carry the per-pair categories and no Stage-2 prefill."""
    problems = synthetic_problems("train", 6, seed=7)
    config = TrainConfig.from_arm(
        "stopped_tree", steps=6, **dict(TREE_FAST, bifurcate_after_active=1, gate_min_chars=None)
    )
    RLVRTrainer(tiny, config, problems, out_dir=tmp_path, progress=False).train()
    lines = read_ledger(tmp_path)
    first_active = next(i for i, line in enumerate(lines) if line["active"])
    for i, line in enumerate(lines):
        categories = {pair[6] for pair in line["pairs"]}
        if i <= first_active:
            assert categories == {"flat_warmup"} and line["stage2_gen"] is None
        else:
            assert categories <= {"causal_non_eos", "terminal_dup"}
            assert line["prefill_run"] == line["prompt_len"], "one prompt prefill, forks after"
    assert first_active < len(lines) - 1, "the run reached tree steps"


@pytest.mark.parametrize("arm", ["zg_flat", "root_restart", "accum4"])
def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path, arm):
    """Tree arms also resume with the count of active steps taken so far (from the ledger);
    multi-question steps with the questions they read."""
    problems = synthetic_problems("train", 5, seed=3)
    config = dict(steps=5, checkpoint_every=2, **fast_settings(arm))
    if arm in TREE_ARMS:
        config.update(bifurcate_after_active=1, gate_min_chars=None)
    whole = RLVRTrainer(
        load_policy("tiny"),
        TrainConfig.from_arm(arm, **config),
        problems,
        out_dir=tmp_path / "whole",
        progress=False,
    )
    whole.train()

    interrupted = RLVRTrainer(
        load_policy("tiny"),
        TrainConfig.from_arm(arm, **config),
        problems,
        out_dir=tmp_path / "resumed",
        progress=False,
    )
    kill_during_step(interrupted, 3)
    assert len(read_ledger(tmp_path / "resumed")) == 3  # step 2 ran after the last checkpoint

    resumed = RLVRTrainer(
        load_policy("tiny"),
        TrainConfig.from_arm(arm, **config),
        problems,
        out_dir=tmp_path / "resumed",
        resume=True,
        progress=False,
    )
    assert resumed.start_step == 2
    resumed.train()
    for (name, a), (_, b) in zip(
        whole.policy.model.named_parameters(), resumed.policy.model.named_parameters()
    ):
        assert torch.equal(a, b), name

    def without_times(lines):
        return [{k: v for k, v in line.items() if k != "seconds"} for line in lines]

    assert without_times(read_ledger(tmp_path / "whole")) == without_times(
        read_ledger(tmp_path / "resumed")
    )


def test_resume_reads_the_rng_states_onto_the_cpu(tiny, tmp_path, monkeypatch):
    """Generator.set_state and torch.set_rng_state take CPU byte tensors (a CUDA generator's
    state too), so a checkpoint must not be mapped onto the policy's device: resume on a GPU
    crashed so. Here the policy reports the meta device, standing in for CUDA (tensors mapped
    onto it hold no data)."""
    problems = synthetic_problems("train", 1, seed=3)
    trainer = RLVRTrainer(
        tiny,
        TrainConfig.from_arm("zg_flat", steps=1, **FAST),
        problems,
        out_dir=tmp_path,
        progress=False,
    )
    trainer.train()
    path = RunLayout(tmp_path).checkpoint
    saved = load_state(path)
    trainer.generator.manual_seed(12345)
    loaded = []

    def recording_read(*args, **kwargs):
        state, digested = read_state(*args, **kwargs)
        loaded.append(state)
        return state, digested

    monkeypatch.setattr(checkpoint, "read_state", recording_read)
    monkeypatch.setattr(Policy, "device", property(lambda self: torch.device("meta")))
    assert trainer.load_checkpoint(path) == 1
    assert loaded[0]["generator"].device.type == loaded[0]["torch_rng"].device.type == "cpu"
    assert torch.equal(trainer.generator.get_state(), saved["generator"])


def record_nvtx(monkeypatch) -> list:
    """NVTX calls as they happen: a range's name when pushed, None when popped."""
    events = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", events.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append(None))
    return events


def test_phases_are_nvtx_ranges_closed_after_a_sync_on_cuda(monkeypatch):
    """The CUDA-only code of ``Phases`` with torch.cuda faked, so it runs anywhere: a phase's
    range closes after a device sync, so its time covers the GPU work queued inside it."""
    events = record_nvtx(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *device: events.append("sync"))
    phase = Phases(torch.device("cuda"))
    with phase("rollout"):
        events.append("work")
    with phase("backward"):
        pass
    assert events == ["rollout", "work", "sync", None, "backward", "sync", None]
    assert set(phase.seconds) == {"rollout", "backward"}
    events.clear()
    with Phases(torch.device("cpu"))("rollout"):
        pass
    assert events == []


CUDA_FAST = dict(FAST, max_batch=8)


@pytest.mark.cuda
@pytest.mark.parametrize("arm", ["baseline", "stopped_tree"])
def test_cuda_training_in_bf16_with_the_generator_on_the_device(tmp_path, arm):
    problems = synthetic_problems("train", 2, seed=5)
    settings = dict(fast_settings(arm), max_batch=8)
    trainer = RLVRTrainer(
        load_policy("tiny", device="cuda"),
        TrainConfig.from_arm(arm, steps=2, **settings),
        problems,
        out_dir=tmp_path,
        progress=False,
    )
    assert trainer.policy.dtype == torch.bfloat16
    assert trainer.generator.device.type == "cuda"
    trainer.train()
    lines = read_ledger(tmp_path)
    assert [line["step"] for line in lines] == [0, 1]
    assert all(line["loss"] is None or math.isfinite(line["loss"]) for line in lines)
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in trainer.stepping.params)
    if arm == "stopped_tree":
        assert any(line["stage2_gen"] is not None for line in lines), "a tree step ran"


@pytest.mark.cuda
def test_cuda_rollouts_follow_the_run_seed():
    problem = synthetic_problems("train", 1, seed=5)[0]
    texts = []
    for seed in (1, 1, 2):
        trainer = RLVRTrainer(
            load_policy("tiny", device="cuda"),
            TrainConfig.from_arm("zg_flat", seed=seed, **CUDA_FAST),
            [problem],
            progress=False,
        )
        texts.append(trainer.step_on(0, [problem]).texts)
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.cuda
def test_a_cuda_step_shows_every_phase_and_the_engine_in_nvtx(monkeypatch):
    problem = synthetic_problems("train", 1, seed=5)[0]
    trainer = RLVRTrainer(
        load_policy("tiny", device="cuda"),
        TrainConfig.from_arm("baseline", **CUDA_FAST),
        [problem],
        progress=False,
    )
    events = record_nvtx(monkeypatch)
    trainer.step_on(0, [problem])
    names = [event for event in events if event is not None]
    assert events.count(None) == len(names), "every range is closed"
    assert {
        "rollout",
        "reward",
        "forward",
        "backward",
        "optimizer",
        "engine prefill",
        "engine decode",
        "graph replay b=8",
    } <= set(names)


@pytest.mark.cuda
def test_a_cuda_run_resumes_where_its_checkpoint_left_off(tmp_path):
    """After a kill during step 3, the resumed run starts at step 2 with the checkpoint's
    weights and generator state on the GPU, and repeats step 2's rollouts."""
    problems = synthetic_problems("train", 4, seed=3)
    config = TrainConfig.from_arm("zg_flat", steps=4, checkpoint_every=2, **CUDA_FAST)
    interrupted = RLVRTrainer(
        load_policy("tiny", device="cuda"), config, problems, out_dir=tmp_path, progress=False
    )
    kill_during_step(interrupted, 3)
    step_2 = read_ledger(tmp_path)[2]
    saved = load_state(RunLayout(tmp_path).checkpoint)

    resumed = RLVRTrainer(
        load_policy("tiny", device="cuda"),
        config,
        problems,
        out_dir=tmp_path,
        resume=True,
        progress=False,
    )
    assert resumed.start_step == 2 and resumed.generator.device.type == "cuda"
    assert torch.equal(resumed.generator.get_state(), saved["generator"])
    for name, tensor in resumed.policy.model.state_dict().items():
        assert tensor.is_cuda and torch.equal(tensor.cpu(), saved["model"][name]), name
    resumed.train()
    again = read_ledger(tmp_path)[2]
    for key in ("question_id", "rewards", "pairs", "gen"):
        assert again[key] == step_2[key], key


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"group_size": 7}, "group_size must be even"),
        ({"group_size": 0}, "group_size"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": 0.0}, "temperature"),
        ({"lr": -1.0}, "lr"),
        ({"loss_order": "mean"}, "loss_order"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"sampler": "beam"}, "sampler must be one of"),
        (
            {"sampler": "tree", "loss_order": "token_weighted", "group_size": 6},
            "group_size = tree_k",
        ),
        (
            {"sampler": "tree", "loss_order": "token_weighted", "t_max": 600},
            "t_min <= t_max < max_new_tokens",
        ),
        ({"beta": 2.0}, "beta must be in"),
        ({"sampler": "tree"}, "need loss_order token_weighted"),
        ({"early_eos_mode": "x"}, "early_eos_mode must be one of"),
    ],
)
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_arm("baseline", **kwargs)


def test_unknown_arm_and_setting_list_the_valid_names():
    with pytest.raises(ValueError, match="unknown arm 'tree'.*baseline, zg_flat"):
        TrainConfig.from_arm("tree")
    with pytest.raises(ValueError, match="unknown setting 'learning_rate'.*lr"):
        TrainConfig.from_arm("baseline", learning_rate=1e-4)


def test_an_existing_run_is_not_overwritten(tiny, tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    with pytest.raises(RunDirectoryError, match="not empty and not an rlvr_fast run directory"):
        RLVRTrainer(
            tiny,
            TrainConfig.from_arm("baseline", **FAST),
            [IMPOSSIBLE],
            out_dir=tmp_path,
            progress=False,
        )
