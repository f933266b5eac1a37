"""The figures a run shows while it trains, from its ledger lines (``rlvr_fast.ledger.metrics``)."""

from __future__ import annotations

import math

import pytest

from rlvr_fast.ledger.metrics import bar_postfix, log_line, step_metrics


def flat_line(rewards, *, loss=None, grad_norm=None, policy=None, lengths=None):
    lengths = lengths or [10 * (i + 1) for i in range(len(rewards))]
    line = {
        "step": 0,
        "rewards": rewards,
        "homogeneous": len(set(rewards)) == 1,
        "active": loss is not None,
        "lengths": lengths,
        "loss": loss,
        "grad_norm": grad_norm,
        "gen": sum(lengths),
        "pref": 40,
        "bwd_out": 7,
        "bwd_full": 9,
        "flops_out": 1.0,
        "flops_full": 2.0,
        "flops_pad_full": 3.0,
        "seconds": {"rollout": 0.5, "reward": 0.25},
    }
    if policy is not None:
        line["policy"] = policy
    return line


def test_a_flat_step_has_trl_figures_and_the_ledger_counts():
    metrics = step_metrics(flat_line([1.0, 0.0, 1.0, 0.0], loss=-0.5, grad_norm=2.0))
    assert metrics["reward"] == 0.5 and metrics["accuracy"] == 0.5
    # TRL's reward_std: Bessel-corrected over the step's completions.
    assert metrics["reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert metrics["frac_reward_zero_std"] == 0.0
    assert (metrics["loss"], metrics["grad_norm"], metrics["active"]) == (-0.5, 2.0, 1.0)
    assert metrics["completions/mean_length"] == 25.0
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (10, 40)
    assert (metrics["tokens/gen"], metrics["tokens/bwd_full"], metrics["flops/pad_full"]) == (
        100,
        9,
        3.0,
    )
    assert (metrics["seconds/rollout"], metrics["seconds/reward"]) == (0.5, 0.25)


def test_what_a_step_does_not_have_is_left_out_not_zero():
    metrics = step_metrics(flat_line([0.0, 0.0]))
    assert "loss" not in metrics and "grad_norm" not in metrics and "kl" not in metrics
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["active"] == 0.0
    # A completion no reward function scored (null) counts in neither the mean nor accuracy.
    assert step_metrics(flat_line([None, 1.0, 0.0]))["reward"] == 0.5


def test_a_graded_reward_has_an_accuracy_apart_from_its_mean():
    metrics = step_metrics(flat_line([1.0, 0.5, 0.5, 0.0]))
    assert metrics["reward"] == 0.5 and metrics["accuracy"] == 0.25


def test_a_multi_question_step_pools_its_questions():
    line = flat_line([1.0, 1.0], loss=0.1, grad_norm=1.0)
    line["questions"] = [flat_line([1.0, 1.0]), flat_line([0.0, 1.0, 1.0, 1.0])]
    metrics = step_metrics(line)
    assert metrics["reward"] == pytest.approx(5 / 6)
    assert metrics["frac_reward_zero_std"] == 0.5


def test_the_policy_figures_keep_trl_names_on_the_bar_and_in_the_log_line():
    policy = {"kl": 0.01, "entropy": 1.5, "clip_ratio/region_mean": 0.125}
    metrics = step_metrics(flat_line([1.0, 0.0], loss=0.2, grad_norm=3.0, policy=policy))
    assert metrics["kl"] == 0.01 and metrics["clip_ratio/region_mean"] == 0.125
    assert bar_postfix(metrics) == {
        "reward": "0.5",
        "acc": "0.5",
        "loss": "0.2",
        "gnorm": "3",
        "kl": "0.01",
        "entropy": "1.5",
        "clip": "0.125",
    }
    line = log_line(4, 20, metrics)
    assert line.startswith("step 4/20: reward 0.5, accuracy 0.5, frac_reward_zero_std 0, loss 0.2")
    assert "kl 0.01, entropy 1.5, clip_ratio/region_mean 0.125" in line
    assert line.endswith(", 0.75 s")
