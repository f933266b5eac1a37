"""The facade's table of where GRPOConfig fields land in TrainConfig
(``rlvr_fast.trl_compat.mapping``): every name in it exists on both sides, and the same-name
fields it implies reach the config as they are."""

from __future__ import annotations

import dataclasses

from rlvr_fast.train.config import TrainConfig, setting_fields
from rlvr_fast.train.stepping import OPTIMIZERS
from rlvr_fast.trl_compat import GRPOConfig
from rlvr_fast.trl_compat.mapping import RENAMED, SHARDING, TRANSFORMED, mapped_settings
from rlvr_fast.trl_compat.run_setup import optimizer_settings, train_config
from rlvr_fast.trl_compat.support import LATER_TRANSFORMERS_FIELDS, TRL_OPTIMIZERS

OURS = set(setting_fields())
THEIRS = {f.name for f in dataclasses.fields(GRPOConfig)}
# Fields of the CI's transformers that the GPU machine's (5.17) lacks count as theirs.
THEIRS_ON_CI = THEIRS | LATER_TRANSFORMERS_FIELDS


def test_every_name_in_the_table_is_a_setting_on_both_sides():
    assert set(RENAMED.values()) <= OURS
    assert all(hasattr(GRPOConfig, name) or name in THEIRS for name in RENAMED)
    assert TRANSFORMED <= OURS & THEIRS_ON_CI
    assert set(SHARDING) <= THEIRS and {s for ours in SHARDING.values() for s in ours} <= OURS


def test_same_name_fields_reach_the_config_as_they_are(tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        loss_type="vespo",
        vespo_lambda_neg=0.5,
        epsilon=0.15,
        seed=7,
        beta=0.05,
        num_generations=4,
    )
    settings = mapped_settings(args)
    assert settings["vespo_lambda_neg"] == 0.5 and settings["seed"] == 7
    assert settings["kl_beta"] == 0.05 and "beta" not in settings  # ours is the tree bonus
    config = train_config(args, max_steps=3, prompts_per_step=1)
    assert (config.vespo_lambda_neg, config.epsilon, config.kl_beta) == (0.5, 0.15, 0.05)
    assert config.group_size == 4 and config.beta == TrainConfig().beta


def test_every_trl_optimizer_steps_one_of_ours(tmp_path):
    assert set(TRL_OPTIMIZERS.values()) <= set(OPTIMIZERS)
    for optim, ours in TRL_OPTIMIZERS.items():
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, optim=optim)
        config = TrainConfig(**optimizer_settings(args), fused_zero_grad_step=False)
        assert config.optimizer == ours
        assert config.adamw_fused == (optim == "adamw_torch_fused")
