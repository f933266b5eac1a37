"""Pooled multi-question steps (``combine_questions="pooled"``, TRL's several prompts per step)
and ``advantage_std="batch"``: the step's one loss against an eager reference over all its
completions, the weights, the ledger verify re-derives, and config.json keeping its bytes when
neither is set (TRL's own gradient is tested side by side in tests/trl_compat)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.credit.group import scored_std, standardised_advantages
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.losses import completion_batch
from rlvr_fast.train.steps import pooled_weights
from rlvr_fast.train.trainer import RLVRTrainer


class CountingKind:
    def loss_count(self, question) -> int:
        return question

    def step_normaliser(self, questions) -> int:
        return sum(questions)


def test_pooled_weights_are_each_questions_share_of_the_steps_count():
    weights = pooled_weights(CountingKind(), [10, 30, 60], [30, 60])
    assert weights == [0.3, 0.6]


def settings(**overrides):
    return dict(
        steps=2,
        max_new_tokens=16,
        eval_max_new_tokens=16,
        lr=1e-3,
        loss_order="token_weighted",
        skip_zero_var=True,
        zero_var_step="zero_grad",
        questions_per_step=2,
        combine_questions="pooled",
        eval_before=False,
        **overrides,
    )


class VariedTask:
    """Rewards that differ within groups (token ids mod 5), so every question contributes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, problem):
        return self.tokenizer.encode(problem.question)

    def rewards(self, problems, texts, completions):
        return [[float(sum(c) % 5) for c in group] for group in completions]


def reference_loss(model, questions, config) -> torch.Tensor:
    """TRL's loss of the step, eagerly: -sum over every completion token of A_i times log pi,
    over the step's tokens (dapo) or (1 / completions) sum_i (1 / |o_i|) sum_t (grpo)."""
    rewards = [q.credit.rewards for q in questions]
    step_std = scored_std([r for g in rewards for r in g])
    total, tokens, completions = 0.0, 0, 0
    for question, group in zip(questions, rewards):
        std = step_std if config.advantage_std == "batch" else None
        advantages, _ = standardised_advantages(group, scale_std=std)
        ids, targets, mask = completion_batch(
            question.prompt_ids, question.rollouts.completions, "cpu"
        )
        logits = model(ids[:, :-1])[:, len(question.prompt_ids) - 1 :]
        logp = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        logp = logp.view_as(targets) * mask
        if config.loss_type == "dapo":
            total = total - (advantages[:, None] * logp).sum()
        else:
            total = total - (advantages * logp.sum(1) / mask.sum(1)).sum()
        tokens += int(mask.sum())
        completions += len(group)
    return total / (tokens if config.loss_type == "dapo" else completions)


@pytest.mark.parametrize(
    "overrides",
    [dict(loss_type="dapo"), dict(loss_type="grpo"), dict(loss_type="dapo", advantage_std="batch")],
)
def test_a_pooled_step_is_the_gradient_of_one_loss_over_all_its_completions(overrides):
    policy = load_policy("tiny")
    config = TrainConfig.from_arm("baseline", **settings(**overrides))
    problems = synthetic_problems("train", 4, seed=3)
    trainer = RLVRTrainer(
        policy, config, problems, progress=False, task=VariedTask(policy.tokenizer)
    )
    captured = []
    sample = trainer.kind.sample

    def keep(questions, bases, **kwargs):
        sample(questions, bases, **kwargs)
        captured.append(questions)

    trainer.kind.sample = keep
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    grads = []
    clip = trainer.stepping.clip_gradients

    def capture():
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        return clip()

    trainer.stepping.clip_gradients = capture
    trainer.step_on(0, problems[:2])
    assert all(trainer.kind.contributes(q) for q in captured[0])
    reference = policy.model
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(before[name])
    reference.zero_grad()
    reference_loss(reference, captured[0], config).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[0][name], p.grad, rtol=1e-4, atol=1e-6)


def test_a_pooled_run_writes_a_ledger_that_verify_rederives(tmp_path):
    policy = load_policy("tiny")
    config = TrainConfig.from_arm("ra_flat", **settings(gate_min_chars=None, loss_type="dapo"))
    RLVRTrainer(policy, config, synthetic_problems("train", 4, seed=11), out_dir=tmp_path).train()
    assert json.loads((tmp_path / "config.json").read_text())["config"]["combine_questions"] == (
        "pooled"
    )
    assert verify_run(tmp_path).ok


def test_config_json_holds_the_new_settings_only_when_set():
    default = TrainConfig.from_arm("accum4").to_json()
    assert "combine_questions" not in default and "advantage_std" not in default
    pooled = TrainConfig.from_arm("accum4", combine_questions="pooled").to_json()
    assert pooled["combine_questions"] == "pooled"
    assert TrainConfig(**pooled) == TrainConfig.from_arm("accum4", combine_questions="pooled")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(combine_questions="pooled"), "combine_questions combines the questions"),
        (dict(combine_questions="mean"), "combine_questions must be one of"),
        (dict(advantage_std="batch", scale_rewards=False), "advantage_std batch"),
        (dict(advantage_std="batch", sampler="tree"), "apply to flat arms only"),
    ],
)
def test_new_settings_are_refused_where_they_cannot_apply(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_arm("baseline", **overrides)
