"""What rlvr_fast does with each of the 191 fields of TRL 1.16's ``GRPOConfig``.

Every field is in exactly one table (``tests/trl_compat/test_trl_config.py`` checks them against
the installed ``trl`` and fails on a field none classifies):
- ``HONOURED``: rlvr_fast does what TRL does with the field (``VALUE_LIMITS`` names the values
  of an honoured field that it cannot honour, refused with the reason; ``REFUSAL_OF`` works the
  reason out for the FSDP settings);
- ``NO_EFFECT``: a setting of how transformers or TRL execute that cannot change what rlvr_fast
  computes; any value is taken, for the reason given;
- ``REFUSED``: a feature rlvr_fast does not implement; TRL's default is taken (a script may
  spell it out), any other value raises ``UnsupportedFieldError`` with the reason.
``check_setting`` applies them, at construction and on every assignment after it.
"""

from __future__ import annotations

import json
from enum import Enum

from rlvr_fast.ops.loss_types import LOSS_TYPE_NAMES
from rlvr_fast.trl_compat.fsdp import fsdp_config_refusal, fsdp_refusal
from rlvr_fast.trl_compat.mapping import TRL_SETTINGS

# TRL's optim values rlvr_fast honours, each with the optimizer of rlvr_fast.train.stepping it
# steps (the one list of optimizers: its OPTIMIZERS).
TRL_OPTIMIZERS = {"adamw_torch_fused": "adamw", "adamw_torch": "adamw", "adafactor": "adafactor"}
SCALE_REWARDS = ("group", "batch", "none", True, False)
REPORTERS = ("tensorboard", "wandb")
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
MODEL_INIT_KEYS = frozenset(
    {"dtype", "torch_dtype", "revision", "trust_remote_code", "attn_implementation"}
    | {"use_cache", "low_cpu_mem_usage", "device_map"}
)

# generation_kwargs keys: overriding GRPOConfig's sampling fields, as TRL's update of its
# GenerationConfig does; taken with no effect; or only at the value TRL gives them.
GENERATION_KWARGS = ("top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_KWARGS_NO_EFFECT = ("use_cache", "cache_implementation", "disable_compile")
GENERATION_KWARGS_FIXED = {"do_sample": True}

NO_VLLM = "rlvr_fast generates on its own engine, with or without use_vllm (logged)"
NO_HUB = "rlvr_fast never contacts the Hub"
NO_LOADER = "rlvr_fast reads prompts from memory, with no data loader or sampler of transformers"

HONOURED = {
    "output_dir": "checkpoints, the model, logs and completions go there",
    "per_device_train_batch_size": "completions per micro-batch (prompts per step, with the next)",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "num_train_epochs": "run length when max_steps is not set",
    "max_steps": "optimizer steps of the run",
    "gradient_checkpointing": "each decoder layer recomputed in backward (the same gradient)",
    "learning_rate": "AdamW's learning rate",
    "lr_scheduler_type": "transformers' schedule of that name",
    "lr_scheduler_kwargs": "passed to transformers' schedule",
    "warmup_steps": "warmup of the schedule (below 1: a fraction of the run)",
    "optim": "torch's AdamW: adamw_torch_fused (the default) its fused kernel, adamw_torch the single-tensor step; adafactor transformers' Adafactor as the Trainer builds it (no adam_* fields)",
    "weight_decay": "AdamW's decoupled weight decay",
    "adam_beta1": "AdamW's beta1",
    "adam_beta2": "AdamW's beta2",
    "adam_epsilon": "AdamW's epsilon",
    "max_grad_norm": "gradient clipping",
    "bf16": "bfloat16 weights on CUDA (on the CPU rlvr_fast computes in float32)",
    "fp16": "precision fp16-mixed on CUDA (float16 compute, fp32 masters, a dynamic loss scale); on the CPU float32, as accelerate (no autocast, no scaler)",
    "seed": "the prompts' shuffle and the run's sampling generator",
    "use_cpu": "train on the CPU",
    "logging_strategy": "when metrics are logged",
    "logging_steps": "steps between logs",
    "logging_first_step": "log the first step",
    "disable_tqdm": "progress bar, else metrics printed as lines",
    "report_to": "tensorboard and wandb (offline or online as wandb is set up)",
    "run_name": "the run's name for the reporters",
    "eval_strategy": "when eval_dataset is evaluated",
    "eval_steps": "steps between evaluations",
    "eval_delay": "no evaluation before this step",
    "eval_on_start": "evaluate before the first step",
    "per_device_eval_batch_size": "completions per evaluation batch",
    "save_strategy": "when checkpoint-N is written (steps, epoch or never)",
    "save_steps": "steps between checkpoints",
    "save_total_limit": "older checkpoints are deleted",
    "save_only_model": "checkpoints without optimizer and RNG state",
    "remove_unused_columns": "reward functions get only the prompt column",
    "model_init_kwargs": "dtype of a model given as a path (other keys: no effect)",
    "fsdp": "sharded training (TrainConfig.shard fsdp: FSDP2, full shard)",
    "fsdp_config": "the FSDP2 settings rlvr_fast builds; activation_checkpointing recomputes",
    "num_generations": "completions per prompt (G)",
    "num_generations_eval": "completions per prompt in evaluation",
    "max_completion_length": "cap on each completion",
    "shuffle_dataset": "TRL's seeded shuffle of the prompts every epoch",
    "generation_batch_size": "completions per generation batch",
    "steps_per_generation": "micro-batches per generation batch: a multiple of "
    "gradient_accumulation_steps, the batch shuffled and split over the optimizer steps",
    "temperature": "sampling temperature (and TRL's tempered log-probabilities in the loss)",
    "top_p": "nucleus sampling",
    "top_k": "top-k sampling before top-p, as transformers orders them",
    "min_p": "min-p sampling after top-p (relative to the largest probability)",
    "repetition_penalty": "transformers' penalty over the prompt and the completion so far",
    "generation_kwargs": f"its keys {', '.join(GENERATION_KWARGS)} (others refused)",
    "use_vllm": "accepted: rollouts run on rlvr_fast's engine, and a log line says so",
    "chat_template_kwargs": "passed to the chat template",
    "use_bias_correction_kl": "the importance-weighted KL estimate",
    "reward_weights": "weighted sum of the reward functions",
    "multi_objective_aggregation": "sum then standardise, or standardise each function then sum",
    "scale_rewards": "advantages divided by the group's std, the step's, or not",
    "loss_type": "TRL's normalisation of the loss over the step's completions or tokens",
    "mask_truncated_completions": "completions cut at the cap leave the loss",
    "log_completions": "a table of prompts and completions printed and saved as JSONL",
    "num_completions_to_print": "rows of the printed table",
    "log_unique_prompts": "one row per prompt in the saved table",
    "max_tool_calling_iterations": "rounds of tool calls a conversation runs (tools=)",
    # The settings declared as TRL fields (rlvr_fast.trl_compat.mapping.TRL_SETTINGS).
    **{name: f.metadata["help"] for name, (f, _) in TRL_SETTINGS.items()},
}

NO_EFFECT = {
    "gradient_checkpointing_kwargs": "activation memory only",
    "activation_checkpointing": "activation memory only",
    "activation_checkpointing_kwargs": "activation memory only",
    "torch_empty_cache_steps": "allocator housekeeping only",
    "torch_compile": "rlvr_fast runs its own kernels",
    "torch_compile_backend": "rlvr_fast runs its own kernels",
    "torch_compile_mode": "rlvr_fast runs its own kernels",
    "use_liger_kernel": "the fused loss never forms the [tokens, vocab] logits already",
    "liger_kernel_config": "the fused loss never forms the [tokens, vocab] logits already",
    "use_cache": "generation runs on rlvr_fast's own paged KV cache",
    "cache_implementation": "generation runs on rlvr_fast's own paged KV cache",
    "label_smoothing_factor": "GRPO's loss has no labels (TRL ignores it too)",
    "average_tokens_across_devices": "GRPO's loss counts its own tokens (TRL ignores it too)",
    "log_level": "log verbosity only",
    "log_level_replica": "log verbosity only",
    "log_on_each_node": "log verbosity only",
    "logging_nan_inf_filter": "a non-finite loss stops an rlvr_fast run",
    "project": "trackio's project; trackio is not a reporter of rlvr_fast",
    "trackio_space_id": "trackio is not a reporter of rlvr_fast",
    "trackio_bucket_id": "trackio is not a reporter of rlvr_fast",
    "trackio_static_space_id": "trackio is not a reporter of rlvr_fast",
    "prediction_loss_only": "GRPO's evaluation computes no predictions",
    "eval_do_concat_batches": "GRPO's evaluation computes no predictions",
    "eval_use_gather_object": "GRPO's evaluation computes no predictions",
    "eval_accumulation_steps": "GRPO's evaluation computes no predictions",
    "include_for_metrics": "GRPO's evaluation computes no predictions",
    "batch_eval_metrics": "GRPO's evaluation computes no predictions",
    "label_names": "GRPO's loss has no labels",
    "metric_for_best_model": "only for load_best_model_at_end or save_strategy best (refused)",
    "greater_is_better": "only for load_best_model_at_end or save_strategy best (refused)",
    "save_on_each_node": "one process writes checkpoints",
    "hub_token": f"only for push_to_hub (refused: {NO_HUB})",
    "hub_private_repo": f"only for push_to_hub (refused: {NO_HUB})",
    "hub_model_id": f"only for push_to_hub (refused: {NO_HUB})",
    "hub_strategy": f"only for push_to_hub (refused: {NO_HUB})",
    "hub_always_push": f"only for push_to_hub (refused: {NO_HUB})",
    "hub_revision": f"only for push_to_hub (refused: {NO_HUB})",
    "full_determinism": "rlvr_fast's runs are deterministic on a device already",
    "data_seed": "GRPO's sampler is seeded by seed (TRL ignores data_seed too)",
    "dataloader_drop_last": NO_LOADER,
    "dataloader_num_workers": NO_LOADER,
    "dataloader_pin_memory": NO_LOADER,
    "dataloader_persistent_workers": NO_LOADER,
    "dataloader_prefetch_factor": NO_LOADER,
    "dataloader_multiprocessing_context": NO_LOADER,
    "dataloader_in_order": NO_LOADER,
    "train_sampling_strategy": NO_LOADER,
    "length_column_name": NO_LOADER,
    "ddp_find_unused_parameters": "rlvr_fast all-reduces gradients itself (torch.distributed)",
    "ddp_bucket_cap_mb": "rlvr_fast all-reduces gradients itself (torch.distributed)",
    "ddp_broadcast_buffers": "rlvr_fast all-reduces gradients itself (torch.distributed)",
    "ddp_static_graph": "rlvr_fast all-reduces gradients itself (torch.distributed)",
    "ddp_backend": "rlvr_fast picks NCCL on GPUs and gloo on CPUs",
    "ddp_timeout": "rlvr_fast's collectives have their own timeout",
    "do_train": "a flag for scripts",
    "do_eval": "a flag for scripts (eval_strategy decides)",
    "do_predict": "a flag for scripts",
    "resume_from_checkpoint": "a value for scripts to pass to train()",
    "local_rank": "set by the launcher",
    "trust_remote_code": "rlvr_fast runs its own model code",
    "router_aux_loss_coef": "the architectures rlvr_fast runs have no router",
    "disable_dropout": "the architectures rlvr_fast runs have no dropout",
    "cast_lm_head_to_fp32": "the fused loss computes the LM head's log-softmax in float32",
    "ds3_gather_for_generation": "DeepSpeed is not used",
    "pad_to_multiple_of": "rlvr_fast's batches are not padded to compiled shapes",
    "vllm_mode": NO_VLLM,
    "vllm_model_impl": NO_VLLM,
    "vllm_enable_sleep_mode": NO_VLLM,
    "vllm_structured_outputs_regex": NO_VLLM,
    "vllm_server_base_url": NO_VLLM,
    "vllm_server_host": NO_VLLM,
    "vllm_server_port": NO_VLLM,
    "vllm_server_timeout": NO_VLLM,
    "vllm_group_port": NO_VLLM,
    "vllm_gpu_memory_utilization": NO_VLLM,
    "vllm_max_model_length": NO_VLLM,
    "vllm_tensor_parallel_size": NO_VLLM,
    "vllm_importance_sampling_correction": NO_VLLM,
    "vllm_importance_sampling_mode": NO_VLLM,
    "vllm_importance_sampling_clip_max": NO_VLLM,
    "vllm_importance_sampling_clip_min": NO_VLLM,
    "vllm_importance_sampling_cap": NO_VLLM,
    "log_multimodal": "rlvr_fast trains text models",
    "use_transformers_continuous_batching": "rlvr_fast's engine batches continuously already",
    "transformers_continuous_batching_config": "rlvr_fast's engine batches continuously already",
    "use_transformers_paged": "rlvr_fast's engine batches continuously already",
}

REFUSED = {
    "optim_args": "arguments of optimizers other than AdamW",
    "optim_target_modules": "GaLore-style optimizers",
    "bf16_full_eval": "a precision of its own for evaluation",
    "fp16_full_eval": "a precision of its own for evaluation",
    "tf32": "a matmul precision other than torch's default",
    "neftune_noise_alpha": "noise on the embeddings",
    "auto_find_batch_size": "shrinking the batch on out-of-memory (TRL refuses it too)",
    "include_num_input_tokens_seen": "transformers' token counter (num_tokens is logged)",
    "skip_memory_metrics": "memory metrics in the train metrics",
    "enable_jit_checkpoint": "checkpoints on a termination signal",
    "push_to_hub": NO_HUB,
    "log_completions_hub_repo": NO_HUB,
    "load_best_model_at_end": "picking a checkpoint by an evaluation metric",
    "ignore_data_skip": "resuming with the data order restarted",
    "restore_callback_states_from_checkpoint": "callback states in checkpoints",
    "accelerator_config": "accelerate's data-loader and batch settings",
    "parallelism_config": "tensor, context or sequence parallelism",
    "deepspeed": "DeepSpeed (rlvr_fast's data parallel all-reduces gradients)",
    "debug": "transformers' debug modes",
}

# Honoured fields whose values rlvr_fast cannot all honour, each with why a value is not (None
# when it is): the FSDP settings (rlvr_fast.trl_compat.fsdp).
REFUSAL_OF = {"fsdp": fsdp_refusal, "fsdp_config": fsdp_config_refusal}

# Values of honoured fields that rlvr_fast cannot honour: (accepted(value), why not).
VALUE_LIMITS = {
    "optim": (
        lambda v: str(v) in TRL_OPTIMIZERS,
        f"rlvr_fast steps AdamW or Adafactor ({', '.join(TRL_OPTIMIZERS)})",
    ),
    "lr_scheduler_type": (
        lambda v: str(v) not in METRIC_SCHEDULERS,
        "schedules driven by evaluation metrics",
    ),
    "save_strategy": (lambda v: str(v) != "best", "picking a checkpoint by a metric"),
    "loss_type": (
        lambda v: v in LOSS_TYPE_NAMES,
        f"rlvr_fast trains the loss types {', '.join(LOSS_TYPE_NAMES)}",
    ),
    "scale_rewards": (lambda v: v in SCALE_REWARDS, "group, batch, none, True or False"),
    "multi_objective_aggregation": (
        lambda v: v in ("sum_then_normalize", "normalize_then_sum"),
        "sum_then_normalize or normalize_then_sum",
    ),
    "importance_sampling_level": (lambda v: v in ("token", "sequence"), "token or sequence"),
    "delta": (lambda v: v is None or v > 0, "a clip at or below 0"),
    "beta": (lambda v: v >= 0, "a negative KL weight"),
    "report_to": (
        lambda v: all(r in REPORTERS + ("none", "all") for r in _listed(v)),
        f"rlvr_fast reports to {', '.join(REPORTERS)}",
    ),
    "generation_kwargs": (
        lambda v: _generation_kwargs_accepted(v),
        f"generation_kwargs takes {', '.join(GENERATION_KWARGS)}, do_sample=True and "
        f"{', '.join(GENERATION_KWARGS_NO_EFFECT)} (no effect)",
    ),
    "model_init_kwargs": (
        lambda v: not isinstance(v, dict) or set(v) <= MODEL_INIT_KEYS,
        f"from_pretrained arguments other than {', '.join(sorted(MODEL_INIT_KEYS))}",
    ),
}

DEFAULTS_ACCEPTED = {
    "debug": ("", [], None),
    # HfArgumentParser reads the str | bool default "no" as False.
    "include_num_input_tokens_seen": ("no", False),
}


class UnsupportedFieldError(ValueError):
    """A TRL setting rlvr_fast does not implement was given a value it cannot honour."""


def _generation_kwargs_accepted(value) -> bool:
    """None, or a dict (or its JSON, as transformers parses it later) of the keys that map."""
    if isinstance(value, str) and value.startswith("{"):
        value = json.loads(value)
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    fixed = all(value[k] == v for k, v in GENERATION_KWARGS_FIXED.items() if k in value)
    known = set(GENERATION_KWARGS) | set(GENERATION_KWARGS_NO_EFFECT) | set(GENERATION_KWARGS_FIXED)
    return fixed and set(value) <= known


def _listed(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _same(value, accepted) -> bool:
    """Equal, and a bool only to a bool (False == 0, but top_k=False is no default)."""
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def plain(value):
    """An enum's value (transformers turns strategy and scheduler names into enums)."""
    return value.value if isinstance(value, Enum) else value


def check_setting(name: str, value, default) -> None:
    """Raise ``UnsupportedFieldError`` naming ``name`` when rlvr_fast cannot honour ``value``."""
    value = plain(value)
    if name in REFUSED:
        accepted = DEFAULTS_ACCEPTED.get(name, (default,))
        if not any(_same(value, a) for a in accepted):
            raise UnsupportedFieldError(
                f"GRPOConfig: {name}={value!r} is not supported by rlvr_fast: {REFUSED[name]} "
                f"(it takes only TRL's default, {default!r})"
            )
    elif name in REFUSAL_OF:
        why = REFUSAL_OF[name](value)
        if why is not None:
            raise UnsupportedFieldError(f"GRPOConfig: {name} is not supported by rlvr_fast: {why}")
    elif name in VALUE_LIMITS:
        accepted, why = VALUE_LIMITS[name]
        if not accepted(value):
            raise UnsupportedFieldError(
                f"GRPOConfig: {name}={value!r} is not supported by rlvr_fast: {why}"
            )


# TrainingArguments fields that transformers 5.17 (the GPU machine's) does not have yet, so
# neither has TRL's GRPOConfig there: classified above all the same (rlvr_fast's GRPOConfig keeps
# them, with no effect, on every version).
LATER_TRANSFORMERS_FIELDS = frozenset(
    {"activation_checkpointing", "activation_checkpointing_kwargs"}
)


def classification(name: str) -> str | None:
    """ "honoured", "no effect", "refused", or None for a field none of the tables holds."""
    for table, label in ((HONOURED, "honoured"), (NO_EFFECT, "no effect"), (REFUSED, "refused")):
        if name in table:
            return label
    return None
