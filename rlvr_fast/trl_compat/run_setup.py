"""What ``GRPOTrainer`` builds before its first step: the dataset rows, the rlvr_fast settings of
a ``GRPOConfig`` and the refusal of constructor arguments rlvr_fast does not implement."""

from __future__ import annotations

import dataclasses
import logging

import torch

from rlvr_fast.ops.loss_types import loss_type
from rlvr_fast.train.arms import arm_settings
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.trl_compat.launch import mixed_precision, uses_cpu
from rlvr_fast.trl_compat.lora import lora_fields
from rlvr_fast.trl_compat.mapping import mapped_settings
from rlvr_fast.trl_compat.support import TRL_OPTIMIZERS

logger = logging.getLogger(__name__)


def refuse_unsupported_arguments(**arguments) -> None:
    """GRPOTrainer arguments rlvr_fast does not implement, refused by name when given."""
    reasons = {
        "optimizers": "rlvr_fast steps its own AdamW (with the zero-gradient step)",
        "quantization_config": "quantized models",
        "rollout_func": "custom rollouts",
        "environment_factory": "environments",
    }
    for name, value in arguments.items():
        empty = value in (None, (None, None)) if name == "optimizers" else value is None
        if not empty:
            raise ValueError(
                f"GRPOTrainer: {name}={type(value).__name__} is not supported by rlvr_fast: "
                f"{reasons[name]} (pass {name}=None)"
            )


def dataset_rows(dataset, remove_unused_columns: bool, what: str) -> list[dict]:
    """Rows of a ``datasets.Dataset`` or a list of dicts, each with a ``prompt``."""
    if dataset is None:
        raise ValueError(f"{what} is required")
    rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError(f"{what} is empty")
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise ValueError(f"{what} row {index} has no 'prompt' column")
    if remove_unused_columns:
        rows = [{"prompt": row["prompt"]} for row in rows]
    return rows


def eval_datasets(eval_dataset, remove_unused_columns: bool) -> dict[str, list[dict]]:
    """Eval rows by name: "" for one dataset, each name of a dict (or DatasetDict)."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {
            name: dataset_rows(d, remove_unused_columns, f"eval_dataset[{name!r}]")
            for name, d in eval_dataset.items()
        }
    return {"": dataset_rows(eval_dataset, remove_unused_columns, "eval_dataset")}


def sampler_settings(args) -> dict:
    """top_p, top_k, min_p and repetition_penalty as TRL generates with them: the fields,
    overridden by ``generation_kwargs`` (TRL updates its GenerationConfig with them)."""
    given = dict(
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    given.update({k: v for k, v in (args.generation_kwargs or {}).items() if k in given})
    # None turns a warper off in transformers, as these values do here.
    off = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    return {k: off[k] if v is None else v for k, v in given.items()}


def training_device(args) -> torch.device:
    """CUDA when there is a GPU and neither use_cpu nor accelerate launch --cpu is set, as the
    Trainer chooses."""
    return torch.device("cuda" if torch.cuda.is_available() and not uses_cpu(args) else "cpu")


def optimizer_settings(args) -> dict:
    """optim as transformers' Trainer builds it: torch's AdamW with adam_beta1 / adam_beta2 /
    adam_epsilon (its fused kernel for adamw_torch_fused), or Adafactor, which takes none of
    them (transformers passes it only the learning rate and weight decay)."""
    optim = args.strategy("optim")
    if TRL_OPTIMIZERS[optim] != "adamw":
        return dict(optimizer=TRL_OPTIMIZERS[optim])
    return dict(
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        adamw_fused=optim == "adamw_torch_fused",
    )


def log_vllm_settings(args) -> None:
    """use_vllm=True is accepted: one line says where rollouts run, one which vllm_* settings
    have no effect."""
    if not args.use_vllm:
        return
    logger.warning("use_vllm=True: rollouts run on rlvr_fast's engine (no vLLM is started)")
    vllm = [f for f in dataclasses.fields(args) if f.name.startswith("vllm_") and f.init]
    changed = [
        f"{f.name}={getattr(args, f.name)!r}" for f in vllm if getattr(args, f.name) != f.default
    ]
    logger.warning(
        "the vllm_* settings have no effect on rlvr_fast's engine: "
        + (", ".join(changed) if changed else "all at TRL's defaults")
    )


def train_config(
    args, max_steps: int, prompts_per_step: int, peft_config=None, adapter_weights_given=False
) -> TrainConfig:
    """The rlvr_fast settings of a GRPOConfig (arm presets applied over TRL's loss) and of a
    ``peft_config`` (LoRA: ``rlvr_fast.trl_compat.lora``; ``adapter_weights_given``: a
    PeftModel's adapters, whose weights are loaded)."""
    log_vllm_settings(args)
    study_loss = not loss_type(args.loss_type).fused
    # normalize_then_sum: the standardised sum's group mean is 0, so TRL's (R - step mean) /
    # (step std + 1e-4) is the group-centred advantage over the step's std.
    step_std = args.scale_rewards == "batch" or args.multi_objective_aggregation != (
        "sum_then_normalize"
    )
    settings = dict(
        mapped_settings(args),
        steps=max_steps,
        **sampler_settings(args),
        **optimizer_settings(args),
        max_grad_norm=args.max_grad_norm or None,
        loss_order="token_weighted",
        scale_rewards=step_std or args.scale_rewards != "none",
        advantage_std="batch" if step_std else "group",
        tempered_logprobs=not study_loss,
        # TRL's default is True; it changes nothing without the KL term.
        use_bias_correction_kl=args.use_bias_correction_kl and args.beta != 0.0,
        zero_var_step="zero_grad",
        fused_zero_grad_step=(
            args.strategy("optim") == "adamw_torch"
            if args.fused_zero_grad_step is None
            else args.fused_zero_grad_step
        ),
        eval_before=False,
        questions_per_step=prompts_per_step,
        checkpoint_every=args.num_iterations * args.generation_steps,
    )
    if peft_config is not None:
        settings.update(lora_fields(peft_config, adapter_weights_given))
    if prompts_per_step > 1:
        if not args.skip_zero_variance_backward:
            raise ValueError(
                "GRPOConfig: skip_zero_variance_backward=False takes one prompt per step "
                f"(this one has {prompts_per_step}); zero-variance groups add no gradient either way"
            )
        settings["combine_questions"] = "pooled"
    if args.arm is not None:
        preset = arm_settings(args.arm)
        if preset.get("sampler") == "parallel":
            raise ValueError(
                f"GRPOConfig: arm {args.arm!r} votes on graded answers; reward "
                "functions cannot drive parallel-path arms"
            )
        if not study_loss:
            # TRL's loss types weight every token; the arm's sum-then-scale order is the study's.
            preset.pop("loss_order", None)
        preset.pop("questions_per_step", None)
        settings.update(preset)
    if args.tree:
        settings.update(
            sampler="tree", bifurcate_after_active=settings.get("bifurcate_after_active", 0)
        )
    if settings.get("sampler") == "tree":
        if not study_loss or step_std or args.mask_truncated_completions:
            raise ValueError(
                "GRPOConfig: tree rollouts weight tokens by TreeRL credit; set "
                "loss_type='sum' with scale_rewards='group', "
                "multi_objective_aggregation='sum_then_normalize' and no "
                "mask_truncated_completions"
            )
        settings["tree_k"] = args.num_generations // 2
        settings.pop("advantage_std")
    precision = mixed_precision(args)
    if precision == "fp16":
        # accelerate's fp16 is autocast with a GradScaler on CUDA and neither on the CPU (it
        # turns native AMP on for fp16 only off the CPU): there TRL trains in float32.
        settings["precision"] = "fp16-mixed" if training_device(args).type == "cuda" else "fp32"
    elif precision != "bf16":
        settings["precision"] = "fp32"
    # bf16 (TRL's default unless fp16) leaves precision None: bf16-mixed on CUDA (Hugging Face
    # Trainer's bf16 is mixed precision over fp32 weights), float32 on the CPU.
    return TrainConfig(**settings)
