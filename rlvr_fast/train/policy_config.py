"""The settings of TRL's policy loss (loss types other than the study's sum, through
``rlvr_fast.train.policy``), the base of ``TrainConfig``: their fields come first in the class
and, written only when set, leave the config.json of runs that do not set them as it was."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlvr_fast.train.fields import FLAT_ONLY, _valid, one_of, setting

IS_LEVELS = ("token", "sequence")


def vespo_setting(default: float, what: str):
    """One of VESPO's gamma weight parameters (TRL's ``vespo_*``)."""
    return setting(
        default,
        f"vespo's gamma {what}",
        math.isfinite,
        "vespo's k and lambda must be finite numbers, got {value}",
        written_when_set=True,
    )


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
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "num_iterations",
    "generation_steps",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "off_policy_mask_threshold",
)
# Settings over the tokens of TRL's micro-batch, which rlvr_fast builds as one question's group
# of one step (``rlvr_fast.train.policy.check_entropy_settings``).
MICRO_BATCH_SETTINGS = ("top_entropy_quantile", "entropy_coef", "use_adaptive_entropy")


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
    vespo_k_pos: float = vespo_setting(2.0, "shape k of positive advantages")
    vespo_lambda_pos: float = vespo_setting(3.0, "rate lambda of positive advantages")
    vespo_k_neg: float = vespo_setting(3.0, "shape k of negative advantages")
    vespo_lambda_neg: float = vespo_setting(2.0, "rate lambda of negative advantages")
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
    top_entropy_quantile: float = setting(
        1.0,
        "TRL's top_entropy_quantile (rho): the policy term keeps only the tokens whose entropy is "
        "at least the 1 - rho quantile of the step's (1: every token)",
        lambda v: 0 <= v <= 1,
        "top_entropy_quantile must be in [0, 1], got {value}",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    entropy_coef: float = setting(
        0.0,
        "TRL's entropy bonus: the loss minus this times the mean entropy of the policy term's "
        "tokens (every group then contributes); the initial coefficient of use_adaptive_entropy",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    use_adaptive_entropy: bool = setting(
        False,
        "TRL's adaptive entropy control: entropy_coef moved by entropy_coef_delta after each "
        "step towards entropy_target, applied only while the entropy is at most the target",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    entropy_target: float = setting(
        0.2, "the adaptive control's target mean entropy (nats)", written_when_set=True
    )
    entropy_coef_min: float = setting(
        0.0, "the adaptive control's lowest coefficient", written_when_set=True
    )
    entropy_coef_max: float = setting(
        1.0, "the adaptive control's highest coefficient", written_when_set=True
    )
    entropy_coef_delta: float = setting(
        0.005, "the adaptive control's step of the coefficient", written_when_set=True
    )
    off_policy_mask_threshold: float | None = setting(
        None,
        "TRL's off-policy sequence mask (DeepSeek-V3.2's OPSM): a sequence of negative advantage "
        "whose mean KL(old || current) exceeds this leaves the policy term (None: none)",
        only_for=FLAT_ONLY,
        written_when_set=True,
    )

    @property
    def entropy_bonus(self) -> bool:
        """TRL's ``_entropy_bonus_enabled``: a coefficient, or the adaptive control (whose
        coefficient may reach 0 and come back)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @property
    def pulls_every_group(self) -> bool:
        """A term with a gradient on a group whose rewards agree: the KL, the entropy bonus."""
        return self.kl_beta > 0 or self.entropy_bonus
