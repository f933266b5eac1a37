"""A setting of the fused policy loss is declared once, in ``PolicyLossSettings``: the run's
``TrainConfig`` field, the facade's ``GRPOConfig`` field and its ``support.HONOURED`` line carry
its default, help and checks (``rlvr_fast.utils.settings``)."""

from __future__ import annotations

import dataclasses

import pytest

from rlvr_fast.ops.policy_loss import PolicyLossSettings
from rlvr_fast.train.config import TrainConfig, setting_fields
from rlvr_fast.train.policy_config import POLICY_SETTINGS, op_settings
from rlvr_fast.trl_compat.config import GRPOConfig
from rlvr_fast.trl_compat.mapping import RENAMED, TRL_SETTINGS
from rlvr_fast.trl_compat.support import HONOURED

RUN_FIELDS = setting_fields()
TRL_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}


def run_name(op_field) -> str:
    return op_field.metadata["run_name"] or op_field.name


def test_every_op_setting_is_a_run_setting_with_its_default_help_and_checks():
    names = [f.name for f in op_settings()]
    assert {"beta", "epsilon", "sapo_temperature_neg", "vespo_k_pos"} <= set(names)
    for op_field in op_settings():
        ours = RUN_FIELDS[run_name(op_field)]
        assert ours.default == op_field.default, op_field.name
        assert ours.metadata["help"] == op_field.metadata["help"], op_field.name
        assert ours.metadata["checks"] == op_field.metadata["checks"], op_field.name
        assert ours.metadata["written_when_set"], op_field.name
        assert run_name(op_field) in POLICY_SETTINGS, op_field.name


def test_the_values_of_one_call_are_not_run_settings():
    for name in ("num_items_in_batch", "gradient_accumulation_steps", "max_completion_length"):
        assert name not in {f.name for f in op_settings()}
        assert name not in RUN_FIELDS


def test_every_trl_setting_is_a_honoured_grpoconfig_field_with_its_default_and_help():
    assert {"beta", "epsilon_high", "vespo_lambda_neg", "entropy_coef_delta"} <= set(TRL_SETTINGS)
    for theirs, (ours, _) in TRL_SETTINGS.items():
        assert TRL_FIELDS[theirs].default == ours.default, theirs
        assert TRL_FIELDS[theirs].metadata["help"] == ours.metadata["help"], theirs
        assert HONOURED[theirs] == ours.metadata["help"], theirs
        assert RENAMED.get(theirs, theirs) == ours.name, theirs
    assert RENAMED["beta"] == "kl_beta"


@pytest.mark.parametrize(
    "name, run, value, message",
    [
        ("sapo_temperature_neg", "sapo_temperature_neg", 0.0, "sapo temperatures must be > 0"),
        ("beta", "kl_beta", -1.0, "kl_beta must be >= 0, got -1.0"),
        ("delta", "delta", 0.0, "delta must be > 0 or None, got 0.0"),
        ("importance_sampling_level", "importance_sampling_level", "seq", "must be one of token"),
    ],
)
def test_an_op_settings_check_refuses_in_the_op_and_in_the_run(name, run, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TrainConfig.from_arm(
            "baseline", loss_type="dapo", loss_order="token_weighted", **{run: value}
        )
    op_message = message.replace("kl_beta", "beta")
    with pytest.raises(ValueError, match=op_message):
        PolicyLossSettings(**{name: value})


def test_a_loss_types_own_settings_are_fields_of_the_op_and_settings_of_the_run():
    from rlvr_fast.ops.loss_types import loss_type

    for name in ("sapo", "vespo"):
        own = loss_type(name).settings
        assert own and all(n in RUN_FIELDS for n, _, _ in own), name
        assert all(n in {f.name for f in op_settings("ratio")} for n, _, _ in own), name
        assert all(n in TRL_SETTINGS for n, _, f in own if f.metadata["trl"]), name
