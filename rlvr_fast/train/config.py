"""``TrainConfig``: every setting of a training run, with its help text in the field's metadata.

Settings by section (each field's ``metadata["help"]`` says what it does):
- run: ``arm`` (the preset, ``rlvr_fast.train.arms``), ``steps``, ``seed``, ``checkpoint_every``,
  ``allow_nonfinite``;
- rollouts: ``group_size``, ``temperature``, ``top_p`` (and TRL's sampler options of
  ``sampling_options``: ``top_k``, ``min_p``, ``repetition_penalty``, off by default),
  ``max_new_tokens``, ``max_batch``, ``cuda_graphs``, ``sampler`` (the step kind: flat, tree or
  parallel);
- optimizer: every setting of ``optim`` (``lr``, ``betas``, ``eps``, ``weight_decay``,
  ``max_grad_norm``), ``fused_zero_grad_step``, ``adamw_fused``, ``optimizer`` (AdamW, or TRL's
  Adafactor);
- reward and stepping: ``gate_min_chars``, ``skip_zero_var``, ``zero_var_step``;
- loss: ``loss_order`` and, on flat arms, TRL's ``loss_type``, ``scale_rewards``,
  ``tempered_logprobs``, ``mask_truncated`` and ``advantage_std``; for TRL's loss types every
  setting of ``policy_loss`` (``rlvr_fast.train.policy_config``: the fused op's, declared in
  ``PolicyLossSettings``, e.g. ``kl_beta`` (TRL's beta), ``epsilon``, ``sapo_temperature_pos``;
  and the loop's around them: the reference sync, ``num_iterations``, ``generation_steps``,
  the adaptive entropy control);
- evaluation: ``eval_max_new_tokens``, ``eval_before``;
- trees: every setting of ``tree`` (``early_eos_mode``, ``tree_k``, ``tree_b``, ``t_min``,
  ``t_max``, ``beta``, ``alpha``, ``clamped_prefix``, ``bifurcate_after_active``,
  ``tree_reprefill``), ``zero_cont_mass``;
- parallel paths: every setting of ``paths`` (``num_paths``, ``aggregator``, ``path_utility``,
  ``path_credit``, ``shapley_permutations``, ``shapley_antithetic``, ``path_reward_norm``,
  ``lambda_outcome``, ``lambda_path``, ``judge_model``);
- the study's Table 3 ablations: ``questions_per_step`` (and ``combine_questions``),
  ``polyak_start``, ``active_steps``;
- LoRA: every setting of ``lora`` (``rlvr_fast.train.lora_config``): ``lora_r`` (unset: every
  weight trains), ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``, ``use_rslora``;
- device: every setting of ``device``: ``precision`` (``rlvr_fast.train.precision``),
  ``activation_checkpointing``, the engine's ``kv_memory_fraction``, ``kv_blocks``,
  ``max_model_len`` (``rlvr_fast.train.memory_plan`` sizes them before anything is allocated),
  ``shard``.

Types are read from the annotations (overrides arrive from the command line as JSON, so a wrong
type is refused by name here rather than failing inside a comparison later; ints are accepted
where floats are). A field's own range is checked by its ``check``; checks across fields of one
step kind live in that kind (``rlvr_fast.train.kinds``); the rest below. ``TrainConfig`` nests
its components by concept (``optim``, ``sampling_options``, ``policy_loss``, ``tree``,
``paths``, ``device``, ``lora``: each a settings class of its own in its module,
``rlvr_fast.utils.settings.NestedSettings``), built, read and set by the
settings' flat names all the same (``config.epsilon`` is ``config.policy_loss.epsilon``);
config.json is flat. Its order is the order of the fields, each component's in its place:
resumed runs compare config.json, so new fields go at the end (or are written only when set).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlvr_fast.credit.shapley import MAX_EXACT_PLAYERS
from rlvr_fast.rollouts.limits import (
    MAX_BATCH,
    MAX_GROUP_SIZE,
    MAX_NEW_TOKENS,
    MAX_QUESTIONS_PER_STEP,
    MAX_SEED,
)
from rlvr_fast.train.arms import ARMS, arm_settings
from rlvr_fast.ops.loss_types import FUSED_LOSS_TYPE_NAMES, LOSS_ORDERS, LOSS_TYPE_NAMES
from rlvr_fast.ops.loss_types import LossType, loss_type
from rlvr_fast.train.decision import ZERO_VAR_STEPS
from rlvr_fast.train.kinds import KINDS, step_kind
from rlvr_fast.train.steps import QUESTION_COMBINATIONS
from rlvr_fast.train.stepping import OPTIMIZERS, check_optimizer_settings
from rlvr_fast.utils.settings import (
    NestedSettings,
    check_settings,
    check_types,
    component,
    flat_fields,
    must_be_one_of,
    one_of,
    setting,
)
from rlvr_fast.train.fields import unknown_setting_error
from rlvr_fast.train.lora_config import AdapterConfig, check_lora
from rlvr_fast.train.policy_config import (
    FLAT_ONLY,
    POLICY_SETTINGS,
    PolicyLossConfig,
    check_micro_batch_settings,
)
from rlvr_fast.train.sampler_config import SamplerOptionsConfig
from rlvr_fast.train.tree_config import TreeConfig
from rlvr_fast.train.paths_config import PathsConfig
from rlvr_fast.train.device_config import DeviceConfig
from rlvr_fast.train.optimizer_config import OptimizerConfig


SAMPLERS = tuple(KINDS)
TREE_ONLY = ("tree", "zero_cont_mass centres tree continuations: it needs sampler tree")
ADVANTAGE_STDS = ("group", "batch")
ADAMW_FUSED_HELP = (
    "torch's fused AdamW kernel (TRL's default optim): none of the temporaries the single-tensor "
    "step takes (twice the largest parameter); zero-gradient steps then run it on zero gradients"
)
OPTIMIZER_HELP = (
    "adamw: torch's AdamW (lr, betas, eps, weight_decay); adafactor: transformers' Adafactor as "
    "TRL's optim='adafactor' builds it (lr, weight_decay; factored second moments, no first "
    "moment: rlvr_fast.train.adafactor)"
)
OPTIMIZER_ERROR = must_be_one_of("optimizer", OPTIMIZERS)
# 10^9 steps is past any run (a 401-digit --steps trained forever).
STEPS_ERROR = "steps must be in [1, 1,000,000,000], got {value}"


@dataclass(init=False)
class TrainConfig(NestedSettings):
    sampling_options: SamplerOptionsConfig = component(SamplerOptionsConfig)
    policy_loss: PolicyLossConfig = component(PolicyLossConfig)
    lora: AdapterConfig = component(AdapterConfig)
    arm: str = setting(
        "baseline",
        "the arm whose preset the settings start from (rlvr_fast.train.arms)",
        one_of(tuple(ARMS)),
        f"unknown arm {{value!r}} (valid: {', '.join(ARMS)})",
    )
    steps: int = setting(50, "optimizer steps of the run", lambda v: 1 <= v <= 10**9, STEPS_ERROR)
    seed: int = setting(
        42,
        "seed of the run's generator: every rollout, and Monte-Carlo Shapley, draw from it",
        lambda v: 0 <= v <= MAX_SEED,
        "seed must be in [0, 2**63 - 1], got {value}",
    )
    group_size: int = setting(
        8,
        "rollouts per question (G); parallel arms: responses of num_paths paths",
        lambda v: 2 <= v <= MAX_GROUP_SIZE and v % 2 == 0,
        f"group_size must be even and in [2, {MAX_GROUP_SIZE}] (rollouts are ledgered in "
        "pairs), got {value}",
    )
    temperature: float = setting(
        0.8,
        "sampling temperature of rollouts",
        lambda v: v > 0,
        "temperature must be > 0 for rollouts, got {value}",
    )
    top_p: float = setting(
        0.9,
        "nucleus of the study's top-p rule",
        lambda v: 0 < v <= 1,
        "top_p must be in (0, 1], got {value}",
    )
    max_new_tokens: int = setting(
        512,
        "cap on each rollout's generated tokens",
        lambda v: 1 <= v <= MAX_NEW_TOKENS,
        f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {{value}}",
    )
    optim: OptimizerConfig = component(OptimizerConfig)
    loss_order: str = setting(
        "sum_then_scale",
        "sum_then_scale: -A_i sum_t log p per sequence (the seed's baseline); token_weighted: "
        "each token's NLL times its weight, through the fused loss",
        one_of(LOSS_ORDERS),
        must_be_one_of("loss_order", LOSS_ORDERS),
    )
    skip_zero_var: bool = setting(False, "homogeneous groups (sigma_R = 0) run no backward pass")
    zero_var_step: str = setting(
        "skip",
        "on a skipped group: zero_grad takes an AdamW step with zero gradients, skip none",
        one_of(ZERO_VAR_STEPS),
        must_be_one_of("zero_var_step", ZERO_VAR_STEPS),
    )
    gate_min_chars: int | None = setting(
        None,
        "derivation gate: reward only a last \\boxed starting at or after this many characters",
        lambda v: v is None or v >= 0,
        "gate_min_chars must be >= 0 or None, got {value}",
    )
    loss_type: str = setting(
        "sum",
        "the study's sum (-A_i sum_t log p, through weighted_token_nll), or one of TRL 1.16's "
        f"loss types ({', '.join(FUSED_LOSS_TYPE_NAMES)}: fused_policy_loss)",
        one_of(LOSS_TYPE_NAMES),
        must_be_one_of("loss_type", LOSS_TYPE_NAMES),
        only_for=FLAT_ONLY,
    )
    scale_rewards: bool = setting(
        True, "divide advantages by std R + 1e-4 (TRL's scale_rewards)", only_for=FLAT_ONLY
    )
    tempered_logprobs: bool = setting(
        False, "train on log softmax(logits / temperature), as TRL does", only_for=FLAT_ONLY
    )
    mask_truncated: bool = setting(
        False,
        "zero weight on completions cut at the cap (TRL's mask_truncated_completions)",
        only_for=FLAT_ONLY,
    )
    eval_max_new_tokens: int = setting(
        2048,
        "cap of greedy evaluation",
        lambda v: 1 <= v <= MAX_NEW_TOKENS,
        f"eval_max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {{value}}",
    )
    max_batch: int = setting(
        256,
        "rows the engine decodes at once",
        lambda v: 1 <= v <= MAX_BATCH,
        f"max_batch must be in [1, {MAX_BATCH}], got {{value}}",
    )
    cuda_graphs: bool = setting(True, "replay CUDA graphs for decode steps on CUDA")
    eval_before: bool = setting(True, "evaluate the eval sets before the first step")
    checkpoint_every: int = setting(
        10, "steps between checkpoints", lambda v: v >= 1, "checkpoint_every must be >= 1"
    )
    fused_zero_grad_step: bool = setting(
        True, "zero-gradient AdamW steps through the fused kernel (no gradient tensors)"
    )
    adamw_fused: bool = setting(False, ADAMW_FUSED_HELP, written_when_set=True)
    sampler: str = setting(
        "flat",
        "the step kind: flat groups, two-stage trees, or parallel paths",
        one_of(SAMPLERS),
        must_be_one_of("sampler", SAMPLERS),
    )
    tree: TreeConfig = component(TreeConfig)
    paths: PathsConfig = component(PathsConfig)
    allow_nonfinite: bool = setting(
        False, "train on after a non-finite loss, gradient norm or weight"
    )
    questions_per_step: int = setting(
        1,
        "questions per optimizer step, each gradient scaled to unit norm (accum4); with "
        "generation_steps > 1, questions sampled per generation",
        lambda v: 1 <= v <= MAX_QUESTIONS_PER_STEP,
        f"questions_per_step must be in [1, {MAX_QUESTIONS_PER_STEP}], got {{value}}",
    )
    zero_cont_mass: bool = setting(
        False, "centre tree continuations' weights to zero signed token mass", only_for=TREE_ONLY
    )
    polyak_start: int = setting(
        0, "FP32 Polyak average of the weights after steps polyak_start.. (0: none)"
    )
    active_steps: int | None = setting(
        None, "end the run after this many steps with a backward pass"
    )
    device: DeviceConfig = component(DeviceConfig)
    combine_questions: str = setting(
        "unit_norm",
        "how a multi-question step combines its questions: unit_norm averages their gradients "
        "scaled to unit norm (accum4); pooled is TRL's several prompts per step, one loss over "
        "all the step's completions normalised as loss_type says (dapo: by the step's tokens; "
        "grpo, dr_grpo and sum: by its completions)",
        one_of(QUESTION_COMBINATIONS),
        must_be_one_of("combine_questions", QUESTION_COMBINATIONS),
        written_when_set=True,
    )
    advantage_std: str = setting(
        "group",
        "the std advantages are divided by: each group's (the study's), or that of all the "
        "step's rewards on every rank (TRL's scale_rewards='batch'); the mean is the group's",
        one_of(ADVANTAGE_STDS),
        must_be_one_of("advantage_std", ADVANTAGE_STDS),
        only_for=FLAT_ONLY,
        written_when_set=True,
    )
    optimizer: str = setting(
        "adamw", OPTIMIZER_HELP, one_of(OPTIMIZERS), OPTIMIZER_ERROR, written_when_set=True
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_settings(self)
        _check_settings_of_other_samplers(self)
        _check_loss(self)
        _check_shapley(self)
        _check_ablations(self)
        check_optimizer_settings(self)
        check_lora(self)
        step_kind(self.sampler).check_config(self)

    @classmethod
    def from_arm(cls, name: str, **overrides) -> "TrainConfig":
        """The arm's preset with ``overrides`` applied (any field of TrainConfig)."""
        if "arm" in overrides:
            raise ValueError("the arm is chosen by name (--arm), not overridden")
        unknown = sorted(set(overrides) - set(setting_fields()))
        if unknown:
            raise ValueError(unknown_setting_error(unknown[0], list(setting_fields())))
        return cls(arm=name, **{**arm_settings(name), **overrides})

    def to_json(self) -> dict:
        """config.json's settings: every field, less those written only when set that hold
        their default."""
        return {
            name: getattr(self, name)
            for name, f in setting_fields().items()
            if not (f.metadata["written_when_set"] and getattr(self, name) == f.default)
        }

    @property
    def loss(self) -> LossType:
        """The record of ``loss_type`` (``rlvr_fast.ops.loss_types``)."""
        return loss_type(self.loss_type)

    @property
    def updates_per_generation(self) -> int:
        """Optimizer steps on one generation: num_iterations x generation_steps."""
        return self.num_iterations * self.generation_steps

    @property
    def questions_needed(self) -> int:
        """Training questions a run of ``steps`` steps reads (it cycles through fewer)."""
        return self.steps * self.questions_per_step


def _check_shapley(config: TrainConfig) -> None:
    exact = config.shapley_permutations == 0 and config.path_credit == "shapley"
    if exact and config.num_paths > MAX_EXACT_PLAYERS:
        raise ValueError(
            f"exact Shapley takes at most {MAX_EXACT_PLAYERS} paths; set "
            f"shapley_permutations for {config.num_paths}"
        )
    if (
        config.shapley_antithetic
        and config.shapley_permutations
        and (config.shapley_permutations < 4 or config.shapley_permutations % 2)
    ):
        raise ValueError(
            "antithetic Monte-Carlo Shapley needs an even shapley_permutations >= 4 "
            "(or shapley_antithetic false)"
        )


def setting_fields() -> dict[str, dataclasses.Field]:
    """Every setting of a run by name, in config.json's order, each a field whose metadata is
    ``rlvr_fast.utils.settings``' (help, checks, only_for, written_when_set, trl): what the
    command line's help and config files read."""
    return flat_fields(TrainConfig)


def _check_settings_of_other_samplers(self: TrainConfig) -> None:
    for f in setting_fields().values():
        if f.metadata["only_for"] is None:
            continue
        kind, error = f.metadata["only_for"]
        if kind != self.sampler and getattr(self, f.name) != f.default:
            raise ValueError(error)


def _check_loss(self: TrainConfig) -> None:
    if not self.loss.fused:
        defaults = {name: f.default for name, f in setting_fields().items()}
        changed = [name for name in POLICY_SETTINGS if getattr(self, name) != defaults[name]]
        if changed:
            raise ValueError(f"{changed[0]} is a setting of TRL's loss types: set loss_type")
    updates = self.updates_per_generation
    if self.checkpoint_every % updates:
        raise ValueError(
            f"checkpoint_every ({self.checkpoint_every}) must be a multiple of num_iterations x "
            f"generation_steps ({updates}): a run resumes at the start of a generation"
        )
    if (self.questions_per_step * self.group_size) % self.generation_steps:
        raise ValueError(
            f"generation_steps ({self.generation_steps}) must divide a generation's "
            f"{self.questions_per_step * self.group_size} completions (questions_per_step x "
            "group_size)"
        )
    if (
        self.generation_steps > 1
        and self.combine_questions != "pooled"
        and (self.questions_per_step > 1)
    ):
        raise ValueError(
            "generation_steps > 1 pools the step's completions: combine_questions pooled"
        )
    if self.sync_ref_model and self.kl_beta == 0.0:
        raise ValueError("sync_ref_model syncs the reference of kl_beta > 0: set kl_beta")
    if self.sync_ref_model and self.lora_r is not None:
        raise ValueError(
            "sync_ref_model with lora_r: under LoRA the reference is the frozen base with the "
            "adapters left out (as TRL's, which refuses the sync with peft too)"
        )
    check_micro_batch_settings(self)
    if self.loss_order != "token_weighted" and (
        self.loss.fused or self.tempered_logprobs or self.mask_truncated
    ):
        raise ValueError(
            "loss_type other than sum, tempered_logprobs and mask_truncated need loss_order "
            "token_weighted"
        )


def _check_ablations(self: TrainConfig) -> None:
    if self.questions_per_step > 1 and not self.skip_zero_var:
        raise ValueError(
            "questions_per_step > 1 needs skip_zero_var: a zero-variance question has no "
            "gradient to scale to unit norm"
        )
    if self.questions_per_step > 1 and self.loss_order != "token_weighted":
        raise ValueError("questions_per_step > 1 needs loss_order token_weighted")
    if self.questions_per_step == 1 and self.combine_questions != "unit_norm":
        raise ValueError("combine_questions combines the questions of questions_per_step > 1")
    if self.advantage_std == "batch" and not self.scale_rewards:
        raise ValueError("advantage_std batch scales rewards: it needs scale_rewards")
    if not 0 <= self.polyak_start <= self.steps:
        raise ValueError(
            f"polyak_start must be in [0, steps = {self.steps}] (0: no Polyak average), got "
            f"{self.polyak_start}"
        )
    if self.active_steps is not None and not 1 <= self.active_steps <= self.steps:
        raise ValueError(
            f"active_steps must be in [1, steps = {self.steps}] (steps caps the run), got "
            f"{self.active_steps}"
        )
