"""The run's settings of TRL's policy loss (loss types other than the study's sum, through
``rlvr_fast.train.policy``): ``PolicyLossConfig``, the component of ``TrainConfig`` that holds
them. Its fields are the settings of the fused op (``rlvr_fast.ops.policy_loss.
PolicyLossSettings``: each declared there once, with its default, help and checks, and derived
here under its run name) and the training loop's own settings around them, declared below:
the reference model's sync, the reuse of a generation, the adaptive entropy control. Each
part's op settings come before the loop's settings of the same term (``RUN_PARTS``), an op
setting of a part not listed at the end; every one is written to config.json only when set,
which leaves the config.json of runs that do not set them as it was."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from rlvr_fast.ops.policy_loss import PolicyLossSettings
from rlvr_fast.utils.settings import is_setting, setting, trl_name

FLAT_ONLY = (
    "flat",
    "loss_type, scale_rewards, tempered_logprobs, mask_truncated, advantage_std and TRL's "
    "policy-loss settings apply to flat arms only",
)


@dataclass
class ReferenceSync:
    """TRL's SyncRefModelCallback: the policy mixed into the KL's reference."""

    sync_ref_model: bool = setting(
        False,
        "mix the policy into the reference every ref_model_sync_steps steps (TRL's)",
        only_for=FLAT_ONLY,
        written_when_set=True,
        trl=True,
    )
    ref_model_sync_steps: int = setting(
        512,
        "steps between reference syncs",
        lambda v: v >= 1,
        "ref_model_sync_steps must be >= 1, got {value}",
        written_when_set=True,
        trl=True,
    )
    ref_model_mixup_alpha: float = setting(
        0.6,
        "ref <- (1 - alpha) ref + alpha policy at each sync",
        lambda v: 0 <= v <= 1,
        "ref_model_mixup_alpha must be in [0, 1], got {value}",
        written_when_set=True,
        trl=True,
    )


@dataclass
class GenerationReuse:
    """Optimizer steps on one generation, against its old log-probabilities."""

    num_iterations: int = setting(
        1,
        "TRL's num_iterations (mu): clipped updates per generation, the old log-probabilities "
        "taken once by a no-gradient pass before the first",
        lambda v: v >= 1,
        "num_iterations must be >= 1, got {value}",
        only_for=FLAT_ONLY,
        written_when_set=True,
        trl=True,
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


@dataclass
class AdaptiveEntropy:
    """TRL's adaptive entropy control (``rlvr_fast.train.policy.EntropyControl``)."""

    use_adaptive_entropy: bool = setting(
        False,
        "TRL's adaptive entropy control: entropy_coef moved by entropy_coef_delta after each "
        "step towards entropy_target, applied only while the entropy is at most the target",
        only_for=FLAT_ONLY,
        written_when_set=True,
        trl=True,
    )
    entropy_target: float = setting(
        0.2, "the adaptive control's target mean entropy (nats)", written_when_set=True, trl=True
    )
    entropy_coef_min: float = setting(
        0.0, "the adaptive control's lowest coefficient", written_when_set=True, trl=True
    )
    entropy_coef_max: float = setting(
        1.0, "the adaptive control's highest coefficient", written_when_set=True, trl=True
    )
    entropy_coef_delta: float = setting(
        0.005, "the adaptive control's step of the coefficient", written_when_set=True, trl=True
    )


# The policy loss's terms in the order of config.json: a part of the op (its settings of that
# ``part``), or a component of the loop's settings.
RUN_PARTS = ("kl", ReferenceSync, "ratio", GenerationReuse, "entropy", AdaptiveEntropy, "mask")


def op_settings(part: str | None = None) -> list[dataclasses.Field]:
    """The settings of the fused op (of one ``part``; None: every one)."""
    return [
        f
        for f in dataclasses.fields(PolicyLossSettings)
        if is_setting(f) and part in (None, f.metadata["part"])
    ]


def run_setting(op_field: dataclasses.Field, hint) -> tuple[str, typing.Any, dataclasses.Field]:
    """The run's setting of an op setting: named ``run_name`` when it has one, for flat arms
    only, written to config.json when set, the same TRL field."""
    meta = op_field.metadata
    (check, error), also = (meta["checks"] + ((None, ""), None))[:2]
    name = meta["run_name"] or op_field.name
    return (
        name,
        hint,
        setting(
            op_field.default,
            meta["help"],
            check,
            error,
            also=also,
            only_for=FLAT_ONLY,
            written_when_set=True,
            trl=trl_name(op_field),
        ),
    )


def run_fields() -> list[tuple[str, typing.Any, dataclasses.Field]]:
    hints = typing.get_type_hints(PolicyLossSettings)
    parts = [p for p in RUN_PARTS if isinstance(p, str)]
    unplaced = [f for f in op_settings() if f.metadata["part"] not in parts]
    fields = []
    for part in RUN_PARTS:
        if isinstance(part, str):
            fields += [run_setting(f, hints[f.name]) for f in op_settings(part)]
        else:
            part_hints = typing.get_type_hints(part)
            fields += [(f.name, part_hints[f.name], f) for f in dataclasses.fields(part)]
    return fields + [run_setting(f, hints[f.name]) for f in unplaced]


def _entropy_bonus(self) -> bool:
    """TRL's ``_entropy_bonus_enabled``: a coefficient, or the adaptive control (whose
    coefficient may reach 0 and come back)."""
    return self.entropy_coef != 0.0 or self.use_adaptive_entropy


def _pulls_every_group(self) -> bool:
    """A term with a gradient on a group whose rewards agree: the KL, the entropy bonus."""
    return self.kl_beta > 0 or self.entropy_bonus


PolicyLossConfig = dataclasses.make_dataclass(
    "PolicyLossConfig",
    run_fields(),
    namespace={
        "__module__": __name__,
        "entropy_bonus": property(_entropy_bonus),
        "pulls_every_group": property(_pulls_every_group),
    },
)

# Settings that need a loss type other than the study's sum: those for flat arms only.
POLICY_SETTINGS = tuple(
    f.name for f in dataclasses.fields(PolicyLossConfig) if f.metadata["only_for"] is FLAT_ONLY
)
# Settings over the tokens of TRL's micro-batch, which rlvr_fast builds as one question's group
# of one step (``rlvr_fast.train.policy.check_entropy_settings``).
MICRO_BATCH_SETTINGS = (*(f.name for f in op_settings("entropy")), "use_adaptive_entropy")


def check_micro_batch_settings(config) -> None:
    """TRL takes the entropy quantile and the entropy bonus's mean over the tokens of one
    micro-batch; rlvr_fast's loss sees one question's group at a time, so a step must be one
    group and one micro-batch."""
    defaults = {f.name: f.default for f in dataclasses.fields(PolicyLossConfig)}
    changed = [n for n in MICRO_BATCH_SETTINGS if getattr(config, n) != defaults[n]]
    if changed and (config.questions_per_step > 1 or config.generation_steps > 1):
        raise ValueError(
            f"{changed[0]} is taken over one question's group per optimizer step on rlvr_fast: "
            "it needs questions_per_step 1 and generation_steps 1"
        )
