"""The loss-type registry (``rlvr_fast.ops.loss_types``): one record per loss type, whose facts
the rest of the package asks instead of branching on names."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.ledger.records import POLICY_FIGURES
from rlvr_fast.ops.loss_types import (
    FUSED_LOSS_TYPE_NAMES,
    LOSS_TYPE_FIGURES,
    LOSS_ORDERS,
    LOSS_TYPE_NAMES,
    LOSS_TYPES,
    LossType,
    loss_type,
    register,
    sum_then_scale_nll,
    token_weighted_nll,
)
from rlvr_fast.ops.policy_loss import PolicyLossSettings


def test_the_names_are_the_registrys():
    assert LOSS_TYPE_NAMES == tuple(dict.fromkeys(name for name, _ in LOSS_TYPES))
    assert LOSS_TYPE_NAMES[0] == "sum" and not loss_type("sum").fused
    assert FUSED_LOSS_TYPE_NAMES == LOSS_TYPE_NAMES[1:]
    assert LOSS_ORDERS == ("sum_then_scale", "token_weighted")


def test_the_study_sum_is_one_record_per_loss_order():
    """The study's sum in each loss order is a record of its own: the flat kind asks the registry
    for its run's (loss_type, loss_order) instead of branching on the order; TRL's types are
    token-weighted only."""
    orders = {loss.order: loss for (name, _), loss in LOSS_TYPES.items() if name == "sum"}
    assert set(orders) == set(LOSS_ORDERS)
    assert orders["sum_then_scale"].study_loss is sum_then_scale_nll
    assert orders["token_weighted"].study_loss is token_weighted_nll
    assert loss_type("sum", order="sum_then_scale") is orders["sum_then_scale"]
    assert loss_type("dapo", order="token_weighted") is loss_type("dapo")
    with pytest.raises(
        ValueError, match="^loss_type dapo is computed in loss_order token_weighted"
    ):
        loss_type("dapo", order="sum_then_scale")


def test_both_study_orders_are_the_seeds_loss():
    """sum_then_scale scales each sequence's summed NLL by A_i; token_weighted weights each token
    by w_it: with w_it = A_i both are -(1/G) sum_i A_i sum_t log p."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 8), torch.randn(11, 8)
    targets, lengths = torch.randint(0, 11, (7,)), [3, 4]
    advantages = torch.tensor([0.5, -1.5])
    token_weights = [a.expand(n) for a, n in zip(advantages, lengths)]
    by_sequence = sum_then_scale_nll(hidden, weight, targets, advantages, None, lengths)
    by_token = token_weighted_nll(hidden, weight, targets, None, token_weights, lengths)
    nll = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="none")
    expected = (advantages[0] * nll[:3].sum() + advantages[1] * nll[3:].sum()) / 2
    torch.testing.assert_close(by_sequence, expected)
    torch.testing.assert_close(by_token, expected)


def test_an_unknown_name_is_one_line_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"^loss_type must be one of sum, grpo, .*got 'ppo'$"):
        loss_type("ppo")
    with pytest.raises(ValueError, match="got 'sum'"):
        loss_type("sum", fused=True)
    with pytest.raises(ValueError, match="registered twice"):
        register(
            LossType("dapo", None, loss_type("dapo").normaliser, study_loss=token_weighted_nll)
        )
    with pytest.raises(ValueError, match="needs an objective or a study loss"):
        register(LossType("ppo", None, loss_type("dapo").normaliser))


def test_normalisers_pool_as_trl_divides():
    """TRL 1.16's _compute_loss: cispo, dapo and vespo divide by the generation batch's tokens,
    bnpo by the micro-batch's; grpo, sapo, dr_grpo and luspo by sequence counts. A pooled step
    weights a question by what its own loss divides by."""
    by_tokens = {loss.name for loss in LOSS_TYPES.values() if loss.normaliser.counts_tokens}
    over_generation = {loss.name for loss in LOSS_TYPES.values() if loss.normaliser.over_generation}
    per_micro_batch = {loss.name for loss in LOSS_TYPES.values() if loss.normaliser.per_micro_batch}
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
