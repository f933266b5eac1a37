"""Training precision on the CPU (bf16 runs here too, slowly): bf16-mixed steps fp32 masters and
moves as many weights as fp32, bf16-true (the study's recipe) loses most updates, the masters
are checkpointed and a resumed run continues them bit for bit."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from rlvr_fast.cli.options import training_precision
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.checkpoint import load_model
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.run.state_file import load_state
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.precision import load_dtype, resolve_precision
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.utils.phases import Phases

ACTIVE = StepDecision(active=True, optimizer_step=True, contributing=1)
ZERO_GRAD = StepDecision(active=False, optimizer_step=True, contributing=0)
TOKENS = torch.tensor([[5, 17, 40, 3, 99, 120, 7, 64, 2, 31, 8, 250]])


@functools.cache
def tiny_fp32():
    return load_policy("tiny", dtype=torch.float32).model


def stepped(precision: str, decisions, lr: float = 1e-5):
    """The tiny model's stepping under ``precision`` after ``decisions`` (next-token loss on a
    fixed sequence); the trained weights (fp32 masters under bf16-mixed) at the start and
    after, by name."""
    model = copy.deepcopy(tiny_fp32()).to(load_dtype(precision))
    config = TrainConfig(lr=lr, max_grad_norm=None)
    stepping = OptimizerStepping(model, config, precision)
    trained = stepping.masters if stepping.masters is not None else model
    start = {n: p.detach().clone() for n, p in trained.named_parameters()}

    def loss():
        logits = model(TOKENS[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits[0], TOKENS[0, 1:])

    for decision in decisions:
        stepping.update(Phases(torch.device("cpu")), decision, [loss])
    return stepping, start, dict(trained.named_parameters())


def moved_fraction(start, now) -> float:
    moved = sum(int((now[name].detach() != value).sum()) for name, value in start.items())
    return moved / sum(value.numel() for value in start.values())


def test_bf16_mixed_moves_as_many_weights_as_fp32_where_bf16_true_loses_most():
    """Three steps at the study's lr 1e-5: every fp32 weight moves, and every master weight of
    bf16-mixed; bf16 weights stepped directly mostly round back to where they were."""
    fractions = {p: moved_fraction(*stepped(p, [ACTIVE] * 3)[1:]) for p in ("fp32", "bf16-mixed")}
    stepping, start, now = stepped("bf16-true", [ACTIVE] * 3)
    assert fractions["fp32"] > 0.99
    # A handful of weights (of 0.88M) whose gradient is exactly zero in one dtype and not in the
    # other.
    assert fractions["bf16-mixed"] == pytest.approx(fractions["fp32"], abs=1e-4)
    assert moved_fraction(start, now) < 0.1  # 6.9% measured
    assert all(p.dtype == torch.bfloat16 for p in stepping.params)


def test_bf16_mixed_keeps_fp32_masters_gradients_and_moments_and_publishes_them():
    stepping, _, masters = stepped("bf16-mixed", [ACTIVE, ZERO_GRAD])
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in stepping.params)
    assert all(m.dtype == torch.float32 for m in masters.values())
    for state in stepping.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert int(state["step"]) == 2  # the zero-gradient step ran on the masters too
    for name, p in stepping.model.named_parameters():
        assert torch.equal(p, masters[name].detach().to(torch.bfloat16)), name


def test_twenty_bf16_mixed_steps_track_fp32():
    """After 20 steps at lr 1e-4 the masters' displacement from the start is the fp32 run's
    within 10% (bf16 forward and backward: the gradients differ at bf16 rounding)."""
    _, start, fp32 = stepped("fp32", [ACTIVE] * 20, lr=1e-4)
    _, _, mixed = stepped("bf16-mixed", [ACTIVE] * 20, lr=1e-4)

    def flat(weights, minus):
        return torch.cat(
            [(weights[n].detach().float() - minus[n].detach().float()).flatten() for n in start]
        )

    error = flat(mixed, fp32).norm() / flat(fp32, start).norm()
    print(f"bf16-mixed vs fp32 after 20 steps: relative error {float(error):.4f}")
    assert error < 0.1


def test_the_device_default_and_what_dtype_means():
    assert resolve_precision(None, torch.device("cuda", 1)) == "bf16-mixed"
    assert resolve_precision(None, torch.device("cpu")) == "fp32"
    assert load_dtype("bf16-mixed") == torch.float32 and load_dtype("bf16-true") == torch.bfloat16
    assert training_precision(None, "bf16") == "bf16-mixed"
    assert training_precision("bf16-true", "bf16") == "bf16-true"
    with pytest.raises(ValueError, match="--dtype fp32 contradicts --precision bf16-mixed"):
        training_precision("bf16-mixed", "fp32")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="bf16")
    # config.json names a precision only when one is set (older runs keep their signature).
    assert "precision" not in TrainConfig().to_json()
    assert TrainConfig(precision="bf16-true").to_json()["precision"] == "bf16-true"


def test_a_bf16_mixed_run_checkpoints_its_masters_and_resumes_bit_for_bit(tmp_path):
    problems = synthetic_problems("train", 2, seed=3)
    config = TrainConfig.from_arm(
        "baseline",
        steps=2,
        checkpoint_every=1,
        max_new_tokens=8,
        eval_max_new_tokens=8,
        lr=1e-4,
        precision="bf16-mixed",
    )

    def trainer(name: str) -> RLVRTrainer:
        policy = load_policy("tiny", dtype=torch.float32)
        return RLVRTrainer(policy, config, problems, out_dir=tmp_path / name, progress=False)

    whole = trainer("whole")
    whole.train()
    saved = load_state(RunLayout(tmp_path / "whole").checkpoint)
    assert all(t.dtype == torch.float32 for t in saved["masters"].values())
    assert all(t.dtype == torch.bfloat16 for t in saved["model"].values())
    # model/ holds the masters in fp32, not their bf16 rounding.
    final = RunLayout(tmp_path / "whole").model()
    assert json.loads((final / "config.json").read_text())["torch_dtype"] == "float32"
    final_weights = dict(load_model(final).named_parameters())
    for name, master in whole.stepping.masters.named_parameters():
        assert torch.equal(final_weights[name], master), name

    interrupted = trainer("resumed")
    interrupted.run_step(0)
    interrupted.save_checkpoint(1)
    interrupted.close()
    resumed = RLVRTrainer(
        load_policy("tiny", dtype=torch.float32),
        config,
        problems,
        out_dir=tmp_path / "resumed",
        resume=True,
        progress=False,
    )
    assert resumed.start_step == 1
    resumed.train()
    for (name, a), b in zip(
        whole.trained_weights.named_parameters(), resumed.stepping.masters.parameters()
    ):
        assert torch.equal(a, b), name


def test_the_engine_and_checkpointing_settings_reach_the_engine_and_the_model():
    config = TrainConfig.from_arm(
        "baseline",
        steps=1,
        max_new_tokens=8,
        kv_blocks=40,
        max_model_len=64,
        activation_checkpointing=True,
    )
    trainer = RLVRTrainer(
        load_policy("tiny"), config, synthetic_problems("train", 1), progress=False
    )
    assert trainer.engine.num_blocks == 40
    assert trainer.policy.model.model.activation_checkpointing
    assert config.to_json()["kv_blocks"] == 40 and "kv_memory_fraction" not in config.to_json()
    with pytest.raises(ValueError, match="kv_memory_fraction must be in"):
        TrainConfig(kv_memory_fraction=0)
