"""The loss-type registry (``rlvr_fast.ops.loss_types``): one record per loss type, whose facts
the rest of the package asks instead of branching on names."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.ledger.records import POLICY_FIGURES
from rlvr_fast.ops.loss_types import (
    FUSED_LOSS_TYPE_NAMES,
    LOSS_TYPE_FIGURES,
    LOSS_TYPE_NAMES,
    LOSS_TYPES,
    LossType,
    loss_type,
    register,
)
from rlvr_fast.ops.policy_loss import PolicyLossSettings


def test_the_names_are_the_registrys():
    assert LOSS_TYPE_NAMES == tuple(LOSS_TYPES)
    assert LOSS_TYPE_NAMES[0] == "sum" and not loss_type("sum").fused
    assert FUSED_LOSS_TYPE_NAMES == LOSS_TYPE_NAMES[1:]


def test_an_unknown_name_is_one_line_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"^loss_type must be one of sum, grpo, .*got 'ppo'$"):
        loss_type("ppo")
    with pytest.raises(ValueError, match="got 'sum'"):
        loss_type("sum", fused=True)
    with pytest.raises(ValueError, match="registered twice"):
        register(LossType("dapo", None, LOSS_TYPES["dapo"].normaliser))


def test_normalisers_pool_as_trl_divides():
    """TRL 1.16's _compute_loss: cispo, dapo and vespo divide by the generation batch's tokens,
    bnpo by the micro-batch's; grpo, sapo, dr_grpo and luspo by sequence counts. A pooled step
    weights a question by what its own loss divides by."""
    by_tokens = {n for n, loss in LOSS_TYPES.items() if loss.normaliser.counts_tokens}
    over_generation = {n for n, loss in LOSS_TYPES.items() if loss.normaliser.over_generation}
    per_micro_batch = {n for n, loss in LOSS_TYPES.items() if loss.normaliser.per_micro_batch}
    assert by_tokens == {"dapo", "bnpo", "cispo", "vespo"}
    assert over_generation == {"dapo", "cispo", "vespo"}
    assert per_micro_batch == {"bnpo"}


def test_every_figure_has_a_ledger_name():
    assert set(LOSS_TYPE_FIGURES) <= set(POLICY_FIGURES)
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.0, 0.7])
    advantages, lengths = torch.tensor([1.0, -1.0]), [2, 3]
    for name in FUSED_LOSS_TYPE_NAMES:
        loss = loss_type(name, fused=True)
        settings = PolicyLossSettings(loss_type=name, max_completion_length=4)
        assert set(loss.figures(ratio, advantages, lengths, settings)) == set(loss.metrics)


def test_a_required_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="loss_type dr_grpo needs max_completion_length"):
        PolicyLossSettings(loss_type="dr_grpo")
