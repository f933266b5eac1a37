"""The settings of TRL's policy loss (loss types other than the study's sum, through
``rlvr_fast.train.policy``), the base of ``TrainConfig``: their fields come first in the class
and, written only when set, leave the config.json of runs that do not set them as it was."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.train.fields import FLAT_ONLY, _valid, one_of, setting

IS_LEVELS = ("token", "sequence")
# Settings that need a loss type other than the study's sum.
POLICY_SETTINGS = (
    "kl_beta",
    "use_bias_correction_kl",
    "sync_ref_model",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "num_iterations",
    "generation_steps",
)


@dataclass
class PolicyLossConfig:
    kl_beta: float = setting(
        0.0,
        "TRL's beta: weight of the k3 KL to a frozen reference model (beta above is the tree "
        "bonus); > 0 makes every group contribute",
        lambda v: v >= 0,
        "kl_beta must be >= 0, got {value}",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    use_bias_correction_kl: bool = setting(
        False, "TRL's importance-weighted KL estimate", only_for=FLAT_ONLY, written_when_set=True
    )
    sync_ref_model: bool = setting(
        False,
        "mix the policy into the reference every ref_model_sync_steps steps (TRL's)",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    ref_model_sync_steps: int = setting(
        512,
        "steps between reference syncs",
        lambda v: v >= 1,
        "ref_model_sync_steps must be >= 1, got {value}",
        written_when_set=True,
    )
    ref_model_mixup_alpha: float = setting(
        0.6,
        "ref <- (1 - alpha) ref + alpha policy at each sync",
        lambda v: 0 <= v <= 1,
        "ref_model_mixup_alpha must be in [0, 1], got {value}",
        written_when_set=True,
    )
    importance_sampling_level: str = setting(
        "token",
        "the importance ratio per token, or per sequence (GSPO)",
        one_of(IS_LEVELS),
        _valid("importance_sampling_level", IS_LEVELS),
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    epsilon: float = setting(
        0.2,
        "lower clip of the ratio, 1 - epsilon",
        lambda v: v >= 0,
        "epsilon must be >= 0, got {value}",
        written_when_set=True,
    )
    epsilon_high: float | None = setting(
        None,
        "upper clip of the ratio, 1 + epsilon_high (None: epsilon); cispo's clip",
        lambda v: v is None or v >= 0,
        "epsilon_high must be >= 0 or None, got {value}",
        written_when_set=True,
    )
    delta: float | None = setting(
        None,
        "two-sided clip: the ratio capped at delta (None: none)",
        lambda v: v is None or v > 0,
        "delta must be > 0 or None, got {value}",
        written_when_set=True,
    )
    sapo_temperature_pos: float = setting(
        1.0,
        "sapo's gate temperature of positive advantages",
        lambda v: v > 0,
        "sapo temperatures must be > 0",
        written_when_set=True,
    )
    sapo_temperature_neg: float = setting(
        1.05,
        "sapo's gate temperature of negative advantages",
        lambda v: v > 0,
        "sapo temperatures must be > 0",
        written_when_set=True,
    )
    num_iterations: int = setting(
        1,
        "TRL's num_iterations (mu): clipped updates per generation, the old log-probabilities "
        "taken once by a no-gradient pass before the first",
        lambda v: v >= 1,
        "num_iterations must be >= 1, got {value}",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    generation_steps: int = setting(
        1,
        "optimizer steps one generation serves (TRL's steps_per_generation / "
        "gradient_accumulation_steps): its completions shuffled (seeded by the run's seed and "
        "the generation), each step trains on the next 1/generation_steps of them, against "
        "old log-probabilities taken once before the first",
        lambda v: v >= 1,
        "generation_steps must be >= 1, got {value}",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
