"""``GRPOConfig``: TRL 1.16's, field for field (``rlvr_fast.trl_compat.fields``, on
``transformers.TrainingArguments`` as TRL's is), plus rlvr_fast's own settings.

``HfArgumentParser`` / ``TrlParser`` build it from a command line or a YAML recipe as they build
TRL's, and its attributes are TRL's (``report_to`` a list, strategies as enums, the generation
batch derived, ...). Every field is honoured, has no effect on what rlvr_fast computes, or is
refused at a value other than TRL's default (``rlvr_fast.trl_compat.support``); a value
rlvr_fast cannot honour raises ``UnsupportedFieldError`` naming the field and why, at
construction and on assignment after it.

Several prompts per optimizer step are counted as TRL counts them: a step trains on
per_device_train_batch_size x gradient_accumulation_steps x world size completions; a
generation batch of per_device_train_batch_size x steps_per_generation x world size completions
(``generation_batch_size``, ``num_generations`` per prompt) is sampled in one batch, its
advantages computed per group over the whole of it, then shuffled and split over
steps_per_generation / gradient_accumulation_steps optimizer steps (rlvr_fast's
``generation_steps``: the later ones off-policy, clipped against the generation's old
log-probabilities). ``steps_per_generation`` must be a multiple of
``gradient_accumulation_steps``: an optimizer step over several generation batches is not
built.

Ours: ``arm`` (a study arm's preset, ``rlvr_fast.train.arms``), ``ledger`` (write the study's
ledger, a run directory ``rlvr-fast verify`` reads, to ``output_dir/ledger``),
``allow_nonfinite`` (train on, and save, after a step's loss, gradient norm or weights turn NaN
or infinite; by default ``train()`` stops there with ``NonFiniteError``, as the CLI does), ``tree``
(two-stage K x B tree rollouts with TreeRL credit), ``skip_zero_variance_backward`` and
``fused_zero_grad_step`` (the zero-gradient AdamW step on zero-variance groups, exact against
TRL's backward of a zero loss; on by default where ``optim="adamw_torch"``: TRL's default
``adamw_torch_fused`` is torch's fused kernel, which steps zero gradients itself), ``tree_t_min`` / ``tree_t_max``. TRL fields older releases had
and 1.16 dropped: ``max_prompt_length`` (prompts longer are cut from the left, as TRL did) and
``warmup_ratio``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlvr_fast.ops.loss_types import loss_type
from rlvr_fast.train.arms import ARMS
from rlvr_fast.trl_compat.fields import TRLFields, trl_field
from rlvr_fast.trl_compat.launch import refuse_accelerate_settings
from rlvr_fast.trl_compat.support import UnsupportedFieldError, check_setting, plain

__all__ = ["GRPOConfig", "UnsupportedFieldError"]


@dataclass
class GRPOConfig(TRLFields):
    # rlvr_fast's own settings
    arm: str | None = trl_field(None, "a study arm's preset on top of TRL's loss (rlvr_fast)")
    ledger: bool = trl_field(False, "write the study's ledger to output_dir/ledger (rlvr_fast)")
    allow_nonfinite: bool = trl_field(
        False, "train on and save after a non-finite loss, gradient norm or weight (rlvr_fast)"
    )
    tree: bool = trl_field(False, "two-stage K x B tree rollouts with TreeRL credit (rlvr_fast)")
    tree_t_min: int = trl_field(96, "tree Stage 1 ends at the first newline from here (rlvr_fast)")
    tree_t_max: int = trl_field(160, "tree Stage 1's cap (rlvr_fast)")
    skip_zero_variance_backward: bool = trl_field(
        True, "zero-variance groups take the zero-gradient AdamW step, no backward (rlvr_fast)"
    )
    fused_zero_grad_step: bool | None = trl_field(
        None,
        "zero-gradient AdamW steps through rlvr_fast's kernel, which reproduces the "
        "single-tensor AdamW step; None: where optim is 'adamw_torch' (rlvr_fast)",
    )
    # TRL fields that 1.16 dropped
    max_prompt_length: int | None = trl_field(None, "keep the last this many prompt tokens")
    warmup_ratio: float | None = trl_field(None, "warmup as a fraction of the run's steps")

    def __post_init__(self) -> None:
        object.__setattr__(self, "_checked", False)
        refuse_accelerate_settings()  # before TrainingArguments builds accelerate's plugins
        for f in dataclasses.fields(self):
            if f.init:
                check_setting(f.name, getattr(self, f.name), field_default(f))
        # TRL's _BaseConfig: bf16 unless fp16, then TrainingArguments' own derivations.
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()
        self._trl_derivations()
        check_setting("report_to", self.report_to, None)
        for ok, message in self._checks():
            if not ok:
                raise ValueError(f"GRPOConfig: {message}")
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_checked") and name in _defaults():
            check_setting(name, value, _defaults()[name])
        super().__setattr__(name, value)

    def _trl_derivations(self) -> None:
        """What TRL's GRPOConfig.__post_init__ derives."""
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = None
        self.scale_rewards = {True: "group", False: "none"}.get(
            self.scale_rewards, self.scale_rewards
        )
        if self.use_transformers_paged:
            self.use_transformers_continuous_batching = True
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        batch = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "GRPOConfig: generation_batch_size and steps_per_generation cannot both be set"
            )
        if self.generation_batch_size is not None:
            if self.generation_batch_size % batch:
                raise ValueError(
                    f"GRPOConfig: generation_batch_size ({self.generation_batch_size}) must be "
                    f"divisible by the global batch size ({batch})"
                )
            self.steps_per_generation = self.generation_batch_size // batch
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        self.generation_batch_size = batch * self.steps_per_generation

    def _checks(self) -> list[tuple[bool, str]]:
        g = self.num_generations
        return [
            (
                g is not None and g >= 2,
                f"GRPO needs num_generations >= 2 to compute advantages, got {g}",
            ),
            (
                g is None or g % 2 == 0,
                f"num_generations must be even (the ledger records rollouts in pairs), got {g}",
            ),
            (
                g is None or self.generation_batch_size % g == 0,
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                f"num_generations ({g})",
            ),
            (
                self.steps_per_generation % self.gradient_accumulation_steps == 0,
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) on rlvr_fast: "
                "an optimizer step over several generation batches is not built",
            ),
            (
                not self._micro_batch_settings() or self.generation_batch_size == g,
                f"{', '.join(self._micro_batch_settings())} take TRL's micro-batch, which rlvr_fast "
                "builds as one prompt's group: they need per_device_train_batch_size = "
                "num_generations, one process and steps_per_generation 1",
            ),
            (
                not loss_type(self.loss_type).normaliser.per_micro_batch
                or self.gradient_accumulation_steps == 1,
                f"loss_type={self.loss_type!r} normalises each micro-batch after TRL's shuffle of "
                "the generation batch; rlvr_fast takes it at gradient_accumulation_steps 1",
            ),
            (
                not (self.fused_zero_grad_step and plain(self.optim) != "adamw_torch"),
                "fused_zero_grad_step=True reproduces the single-tensor AdamW step: it needs "
                f"optim='adamw_torch' (optim={plain(self.optim)!r} steps zero gradients itself)",
            ),
            (
                self.max_completion_length is not None and self.max_completion_length >= 1,
                f"max_completion_length must be >= 1, got {self.max_completion_length}",
            ),
            (
                self.max_prompt_length is None or self.max_prompt_length >= 1,
                "max_prompt_length must be >= 1 or None",
            ),
            (self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (
                self.min_p is None or 0 <= self.min_p <= 1,
                f"min_p must be in [0, 1] or None, got {self.min_p}",
            ),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}"),
            (
                self.warmup_ratio is None or 0 <= self.warmup_ratio <= 1,
                f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}",
            ),
            (
                self.max_steps > 0 or self.num_train_epochs > 0,
                "set max_steps > 0 or num_train_epochs > 0",
            ),
            (
                self.reward_weights is None
                or all(isinstance(w, (int, float)) for w in self.reward_weights),
                "reward_weights must be a list of numbers",
            ),
            (
                self.arm is None or self.arm in ARMS,
                f"arm must be one of {', '.join(ARMS)} or None, got {self.arm!r}",
            ),
            (1 <= self.tree_t_min <= self.tree_t_max, "need 1 <= tree_t_min <= tree_t_max"),
        ]

    def _micro_batch_settings(self) -> list[str]:
        """The entropy settings set away from TRL's defaults."""
        defaults = {"top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False}
        return [name for name, value in defaults.items() if getattr(self, name) != value]

    @property
    def prompts_per_step(self) -> int:
        """Prompts of one generation batch over all processes (TRL's generation batch / G):
        those of one optimizer step unless ``generation_steps`` > 1."""
        return self.generation_batch_size // self.num_generations

    @property
    def generation_steps(self) -> int:
        """Optimizer steps one generation batch is split over (before num_iterations)."""
        return self.steps_per_generation // self.gradient_accumulation_steps

    @property
    def updates_per_generation(self) -> int:
        """Optimizer steps on one generation batch: num_iterations x generation_steps."""
        return self.num_iterations * self.generation_steps

    def resolve_steps(self, value: float, max_steps: int) -> int:
        """A steps setting as transformers reads it: below 1, a fraction of max_steps."""
        return max(1, math.ceil(value * max_steps)) if value < 1 else int(value)

    def warmup(self, max_steps: int) -> int:
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * max_steps)
        return self.get_warmup_steps(max_steps)

    def strategy(self, name: str) -> str:
        """A strategy or optimizer field's value as a plain string ("steps", "epoch", "no",
        "adamw_torch_fused", ...)."""
        return plain(getattr(self, name))


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


_DEFAULTS: dict = {}


def _defaults() -> dict:
    """Every init field's default, by name (computed once)."""
    if not _DEFAULTS:
        _DEFAULTS.update({f.name: field_default(f) for f in dataclasses.fields(GRPOConfig)})
    return _DEFAULTS
