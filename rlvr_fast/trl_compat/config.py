"""``GRPOConfig``: TRL's GRPO settings by TRL's names and defaults (trl 1.16), plus ours.

Every field of ``trl.GRPOConfig`` falls in one of three groups:
- supported: declared below with TRL's default and honoured (``trainer.py`` maps them onto
  ``TrainConfig``, the sampler and the loop);
- ``NO_EFFECT_FIELDS``: settings of how transformers executes (activation checkpointing, data
  loader workers, log verbosity) that cannot change what is computed here; any value is taken;
- ``DEFAULT_ONLY_FIELDS``: everything else; TRL's default is accepted (a script may spell it
  out), any other value raises ``UnsupportedFieldError`` naming the field.
A name in none of them is a ``TypeError``, as for any dataclass. ``tests/trl_compat/test_trl_compat.py``
checks these tables against the installed ``trl``.

Ours: ``arm`` (a study arm's preset, ``rlvr_fast.train.arms``), ``ledger`` (write the study's
ledger, a run directory ``rlvr-fast verify`` reads, to ``output_dir/ledger``),
``allow_nonfinite`` (train on, and save, after a step's loss, gradient norm or weights turn NaN
or infinite; by default ``train()`` stops there with ``NonFiniteError``, as the CLI does), ``tree``
(two-stage K x B tree rollouts with TreeRL credit),
``skip_zero_variance_backward`` and ``fused_zero_grad_step`` (the zero-gradient AdamW step on
zero-variance groups, exact against TRL's backward of a zero loss), ``tree_t_min`` /
``tree_t_max``. TRL fields older releases had and 1.16 dropped: ``max_prompt_length`` (prompts
longer are cut from the left, as TRL did) and ``warmup_ratio``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlvr_fast.train.arms import ARMS

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "sum")
SCALE_REWARDS = ("group", "batch", "none")
LR_SCHEDULERS = ("linear", "constant", "constant_with_warmup", "cosine")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
REPORT_TO = ("none", "tensorboard")
STRATEGIES = ("steps", "no")

NO_EFFECT_FIELDS = frozenset(
    {
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "torch_empty_cache_steps",
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "skip_memory_metrics",
        "do_train",
        "ds3_gather_for_generation",
        "local_rank",
        "ddp_timeout",
    }
)

DEFAULT_ONLY_FIELDS = {
    "lr_scheduler_kwargs": None,
    "optim_args": None,
    "optim_target_modules": None,
    "average_tokens_across_devices": True,
    "label_smoothing_factor": 0.0,
    "fp16": False,
    "bf16_full_eval": False,
    "fp16_full_eval": False,
    "tf32": None,
    "torch_compile": False,
    "torch_compile_backend": None,
    "torch_compile_mode": None,
    "use_liger_kernel": False,
    "liger_kernel_config": None,
    "use_cache": False,
    "neftune_noise_alpha": None,
    "auto_find_batch_size": False,
    "logging_nan_inf_filter": True,
    "include_num_input_tokens_seen": "no",
    "project": "huggingface",
    "trackio_space_id": None,
    "trackio_bucket_id": None,
    "trackio_static_space_id": None,
    "eval_strategy": "no",
    "eval_steps": None,
    "eval_delay": 0,
    "per_device_eval_batch_size": 8,
    "prediction_loss_only": False,
    "eval_on_start": False,
    "eval_do_concat_batches": True,
    "eval_use_gather_object": False,
    "eval_accumulation_steps": None,
    "include_for_metrics": [],
    "batch_eval_metrics": False,
    "save_only_model": False,
    "save_on_each_node": False,
    "save_total_limit": None,
    "enable_jit_checkpoint": False,
    "push_to_hub": False,
    "hub_token": None,
    "hub_private_repo": None,
    "hub_model_id": None,
    "hub_strategy": "every_save",
    "hub_always_push": False,
    "hub_revision": None,
    "load_best_model_at_end": False,
    "metric_for_best_model": None,
    "greater_is_better": None,
    "ignore_data_skip": False,
    "restore_callback_states_from_checkpoint": False,
    "full_determinism": False,
    "data_seed": None,
    "accelerator_config": None,
    "parallelism_config": None,
    "dataloader_drop_last": False,
    "dataloader_in_order": True,
    "label_names": None,
    "train_sampling_strategy": "random",
    "length_column_name": "length",
    "ddp_find_unused_parameters": None,
    "ddp_bucket_cap_mb": None,
    "ddp_broadcast_buffers": None,
    "ddp_static_graph": None,
    "ddp_backend": None,
    "fsdp": None,
    "fsdp_config": None,
    "deepspeed": None,
    "debug": "",
    "do_eval": False,
    "do_predict": False,
    "resume_from_checkpoint": None,
    "model_init_kwargs": None,
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "disable_dropout": False,
    "cast_lm_head_to_fp32": False,
    "num_generations_eval": None,
    "pad_to_multiple_of": "auto",
    "top_k": 0,
    "min_p": None,
    "generation_kwargs": None,
    "repetition_penalty": 1.0,
    "cache_implementation": None,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None,
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": 1,
    "beta": 0.0,
    "num_iterations": 1,
    "delta": None,
    "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "importance_sampling_level": "token",
    "multi_objective_aggregation": "sum_then_normalize",
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005,
    "entropy_target": 0.2,
    "max_tool_calling_iterations": None,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": True,
    "log_completions": False,
    "log_multimodal": True,
    "num_completions_to_print": None,
    "log_unique_prompts": False,
    "log_completions_hub_repo": None,
    "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None,
    "use_transformers_paged": False,
    "vllm_importance_sampling_cap": None,
}


class UnsupportedFieldError(ValueError):
    """A TRL setting rlvr_fast does not implement was given a value other than TRL's default."""


@dataclass(init=False)
class GRPOConfig:
    """TRL's ``GRPOConfig`` (see the module docstring for what is honoured). One optimizer step
    is one prompt's ``num_generations`` completions: per_device_train_batch_size x
    gradient_accumulation_steps must equal num_generations."""

    output_dir: str | None = None
    num_generations: int = 8
    max_completion_length: int = 512
    max_prompt_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    learning_rate: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    optim: str = "adamw_torch_fused"
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    warmup_ratio: float | None = None
    max_steps: int = -1
    num_train_epochs: float = 3.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    seed: int = 42
    shuffle_dataset: bool = True
    remove_unused_columns: bool = False
    chat_template_kwargs: dict | None = None
    loss_type: str = "dapo"
    scale_rewards: str | bool = "group"
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None
    epsilon: float = 0.2
    epsilon_high: float | None = None
    logging_strategy: str = "steps"
    logging_steps: float = 10
    logging_first_step: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    report_to: str | list[str] = "none"
    run_name: str | None = None
    disable_tqdm: bool | None = None
    bf16: bool | None = None
    use_cpu: bool = False
    # ours
    arm: str | None = None
    ledger: bool = False
    allow_nonfinite: bool = False
    tree: bool = False
    tree_t_min: int = 96
    tree_t_max: int = 160
    skip_zero_variance_backward: bool = True
    fused_zero_grad_step: bool = True

    def __init__(self, output_dir: str | None = None, **settings) -> None:
        own = {f.name for f in dataclasses.fields(self)}
        for name, value in settings.items():
            if name in own or name in NO_EFFECT_FIELDS:
                continue
            if name not in DEFAULT_ONLY_FIELDS:
                raise TypeError(
                    f"GRPOConfig: unexpected field {name!r} (not a field of TRL's "
                    "GRPOConfig nor of rlvr_fast's)"
                )
            if value != DEFAULT_ONLY_FIELDS[name]:
                raise UnsupportedFieldError(
                    f"GRPOConfig: {name}={value!r} is not supported by rlvr_fast (it takes "
                    f"only TRL's default, {DEFAULT_ONLY_FIELDS[name]!r})"
                )
        for f in dataclasses.fields(self):
            setattr(self, f.name, settings.get(f.name, f.default))
        self.output_dir = output_dir if output_dir is not None else "trainer_output"
        self.__post_init__()

    def __post_init__(self) -> None:
        self.scale_rewards = {True: "group", False: "none"}.get(
            self.scale_rewards, self.scale_rewards
        )
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "GRPOConfig: generation_batch_size and steps_per_generation cannot both be set"
            )
        if self.steps_per_generation is None:
            self.steps_per_generation = (
                self.gradient_accumulation_steps
                if self.generation_batch_size is None
                else self.generation_batch_size // max(1, self.per_device_train_batch_size)
            )
        if self.generation_batch_size is None:
            self.generation_batch_size = (
                self.per_device_train_batch_size * self.steps_per_generation
            )
        for ok, message in self._checks():
            if not ok:
                raise ValueError(f"GRPOConfig: {message}")

    def _checks(self) -> list[tuple[bool, str]]:
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        return [
            (
                self.num_generations >= 2,
                "GRPO needs num_generations >= 2 to compute advantages, "
                f"got {self.num_generations}",
            ),
            (
                self.num_generations % 2 == 0,
                "num_generations must be even (the ledger records "
                f"rollouts in pairs), got {self.num_generations}",
            ),
            (
                self.generation_batch_size % self.num_generations == 0,
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                f"num_generations ({self.num_generations})",
            ),
            (
                batch == self.num_generations,
                f"per_device_train_batch_size x gradient_accumulation_steps ({batch}) must equal "
                f"num_generations ({self.num_generations}): rlvr_fast steps on one prompt per "
                "optimizer step",
            ),
            (
                self.steps_per_generation == self.gradient_accumulation_steps,
                f"steps_per_generation ({self.steps_per_generation}) must equal "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}): each optimizer "
                "step trains on its own, fresh rollouts",
            ),
            (self.max_completion_length >= 1, "max_completion_length must be >= 1"),
            (
                self.max_prompt_length is None or self.max_prompt_length >= 1,
                "max_prompt_length must be >= 1 or None",
            ),
            (self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}"),
            (
                self.optim in OPTIMIZERS,
                f"optim must be one of {', '.join(OPTIMIZERS)} (AdamW), got {self.optim!r}",
            ),
            (
                self.lr_scheduler_type in LR_SCHEDULERS,
                "lr_scheduler_type must be one of "
                f"{', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler_type!r}",
            ),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (
                self.warmup_ratio is None or 0 <= self.warmup_ratio <= 1,
                f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}",
            ),
            (
                self.max_steps > 0 or self.num_train_epochs > 0,
                "set max_steps > 0 or num_train_epochs > 0",
            ),
            (
                self.loss_type in LOSS_TYPES,
                f"loss_type must be one of {', '.join(LOSS_TYPES)} "
                f"(rlvr_fast), got {self.loss_type!r}",
            ),
            (
                self.loss_type != "bnpo" or self.gradient_accumulation_steps == 1,
                "loss_type='bnpo' normalises per micro-batch; with gradient_accumulation_steps > 1 "
                "that depends on TRL's shuffle of the batch, so rlvr_fast supports it only at 1",
            ),
            (
                self.scale_rewards in SCALE_REWARDS,
                "scale_rewards must be one of "
                f"{', '.join(SCALE_REWARDS)}, True or False, got {self.scale_rewards!r}",
            ),
            (
                self.reward_weights is None
                or all(isinstance(w, (int, float)) for w in self.reward_weights),
                "reward_weights must be a list of numbers",
            ),
            (
                self.logging_strategy in STRATEGIES,
                f"logging_strategy must be one of "
                f"{', '.join(STRATEGIES)}, got {self.logging_strategy!r}",
            ),
            (self.logging_steps > 0, f"logging_steps must be > 0, got {self.logging_steps}"),
            (
                self.save_strategy in STRATEGIES,
                f"save_strategy must be one of {', '.join(STRATEGIES)}, got {self.save_strategy!r}",
            ),
            (self.save_steps > 0, f"save_steps must be > 0, got {self.save_steps}"),
            (
                all(r in REPORT_TO for r in self.report_to),
                f"report_to must be among {', '.join(REPORT_TO)}, got {self.report_to!r}",
            ),
            (
                self.arm is None or self.arm in ARMS,
                f"arm must be one of {', '.join(ARMS)} or None, got {self.arm!r}",
            ),
            (1 <= self.tree_t_min <= self.tree_t_max, "need 1 <= tree_t_min <= tree_t_max"),
        ]

    def resolve_steps(self, value: float, max_steps: int) -> int:
        """A steps setting as TRL reads it: a float below 1 is a fraction of max_steps."""
        return max(1, math.ceil(value * max_steps)) if value < 1 else int(value)

    def warmup(self, max_steps: int) -> int:
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * max_steps)
        return self.resolve_steps(self.warmup_steps, max_steps) if self.warmup_steps else 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
