"""The optimizer of a run: torch's single-tensor AdamW by default, its fused kernel with
``adamw_fused`` (TRL's default optim), whose zero-gradient steps are the fused kernel's own."""

from __future__ import annotations

import copy

import pytest
import torch

from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.utils.phases import Phases

ACTIVE = StepDecision(active=True, optimizer_step=True, contributing=1)
ZERO_GRAD = StepDecision(active=False, optimizer_step=True, contributing=0)
TOKENS = torch.tensor([[5, 17, 40, 3, 99, 120, 7, 64, 2, 31, 8]])
SETTINGS = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=None)


def next_token_loss(model):
    logits = model(TOKENS[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits[0], TOKENS[0, 1:])


def test_adamw_fused_steps_as_torchs_fused_adamw_zero_gradient_steps_included():
    model = load_policy("tiny", dtype=torch.float32).model
    by_hand = copy.deepcopy(model)
    config = TrainConfig(adamw_fused=True, fused_zero_grad_step=False, **SETTINGS)
    stepping = OptimizerStepping(model, config)
    assert all(group["fused"] for group in stepping.optimizer.param_groups)
    reference = torch.optim.AdamW(
        by_hand.parameters(), lr=1e-3, weight_decay=0.1, betas=config.betas, fused=True
    )
    for decision in (ACTIVE, ZERO_GRAD, ACTIVE):
        stepping.update(Phases(torch.device("cpu")), decision, [lambda: next_token_loss(model)])
        if decision.active:
            next_token_loss(by_hand).backward()
        else:
            for p in by_hand.parameters():
                p.grad = torch.zeros_like(p)
        reference.step()
        reference.zero_grad(set_to_none=True)
    ours = dict(model.named_parameters())
    assert all(torch.equal(ours[name], p) for name, p in by_hand.named_parameters())


def test_adamw_fused_refuses_the_single_tensor_zero_gradient_kernel_and_is_written_when_set():
    with pytest.raises(ValueError, match="adamw_fused needs fused_zero_grad_step=false"):
        TrainConfig(adamw_fused=True)
    assert "adamw_fused" not in TrainConfig().to_json()
    assert TrainConfig(adamw_fused=True, fused_zero_grad_step=False).to_json()["adamw_fused"]


@pytest.mark.parametrize(
    "settings",
    [
        dict(optimizer="adamw", weight_decay=0.0),
        dict(optimizer="adamw", weight_decay=0.1),
        dict(optimizer="adafactor", weight_decay=0.0, fused_zero_grad_step=False),
    ],
)
def test_a_zero_gradient_step_publishes_exactly_when_it_moves_the_weights(settings):
    """Without weight decay a zero-gradient step before any first moment (and Adafactor's,
    which keeps none, after an active step too) leaves the weights: nothing is published (a
    sharded run's refresh gathers nothing)."""
    model = load_policy("tiny", dtype=torch.float32).model
    published = []
    config = TrainConfig(lr=1e-3, max_grad_norm=None, **settings)
    stepping = OptimizerStepping(model, config, after_publish=lambda: published.append(True))
    moved = []
    for decision in (ZERO_GRAD, ACTIVE, ZERO_GRAD):
        before = [p.detach().clone() for p in model.parameters()]
        published.clear()
        stepping.update(Phases(torch.device("cpu")), decision, [lambda: next_token_loss(model)])
        changed = not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert published == ([True] if changed else []), decision
        moved.append(changed)
    first_moment = settings["optimizer"] == "adamw"
    assert moved == [
        settings["weight_decay"] > 0,
        True,
        first_moment or settings["weight_decay"] > 0,
    ]
