"""``accelerate launch`` and ``torchrun``: a TRL script started by either runs data-parallel on
rlvr_fast (``rlvr_fast.train.distributed``: one process per device, rank 0 writing).

Both launchers give each process torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; ``accelerate launch --multi_gpu
--num_processes N`` runs torchrun itself), and ``GRPOConfig`` (transformers'
``TrainingArguments``) joins the process group through accelerate's ``PartialState``, as TRL's
does: NCCL on GPUs, gloo on CPUs. Of what ``accelerate launch`` adds (``ACCELERATE_*``):
- honoured: the processes and machines (``--num_processes``, ``--num_machines``,
  ``--machine_rank``, ``--main_process_ip`` / ``--main_process_port``, through torchrun's
  variables), ``--cpu`` (``ACCELERATE_USE_CPU``: train on the CPU, as ``use_cpu``) and
  ``--mixed_precision`` (``ACCELERATE_MIXED_PRECISION``, which transformers reads when neither
  ``bf16`` nor ``fp16`` is set: bf16 or fp16 mixed precision, or none);
- no effect: ``--dynamo_backend`` and its options (rlvr_fast runs its own kernels, as for
  ``torch_compile``), ``--gradient_accumulation_steps`` (transformers' Trainer takes the
  args' own, and so does rlvr_fast);
- sharded (``--use_fsdp --fsdp_version 2``, ``ACCELERATE_USE_FSDP``): rlvr_fast's FSDP2 sharding,
  what it cannot honour refused by name (``rlvr_fast.trl_compat.fsdp``);
- refused by name (``refuse_accelerate_settings``): DeepSpeed and Megatron-LM
  (``--use_deepspeed``, ``--use_megatron_lm``), and fp8 mixed precision.
"""

from __future__ import annotations

import os

from rlvr_fast.trl_compat.fsdp import refuse_accelerate_fsdp

# accelerate's environment variables rlvr_fast refuses when on, with the reason.
REFUSED = {
    "ACCELERATE_USE_DEEPSPEED": (
        "--use_deepspeed",
        "DeepSpeed (rlvr_fast's data parallel all-reduces gradients itself)",
    ),
    "ACCELERATE_USE_MEGATRON_LM": ("--use_megatron_lm", "Megatron-LM model parallelism"),
}
MIXED_PRECISION = ("no", "bf16", "fp16")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def refuse_accelerate_settings() -> None:
    """ValueError naming the ``accelerate launch`` option this process was started with that
    rlvr_fast does not implement."""
    refuse_accelerate_fsdp()
    for variable, (option, reason) in REFUSED.items():
        if env_flag(variable):
            raise ValueError(
                f"accelerate launch {option} ({variable}=true) is not supported by rlvr_fast: "
                f"{reason}; launch without it"
            )
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed not in MIXED_PRECISION:
        raise ValueError(
            f"accelerate launch --mixed_precision {mixed} (ACCELERATE_MIXED_PRECISION) is not "
            f"supported by rlvr_fast: use one of {', '.join(MIXED_PRECISION)}"
        )


def uses_cpu(args) -> bool:
    """``use_cpu``, or ``accelerate launch --cpu`` (``ACCELERATE_USE_CPU``), as transformers
    reads them."""
    return bool(args.use_cpu) or env_flag("ACCELERATE_USE_CPU")


def mixed_precision(args) -> str:
    """transformers' mixed precision of ``args``: fp16 or bf16 when set, else accelerate
    launch's ``--mixed_precision`` (``ACCELERATE_MIXED_PRECISION``), else "no"."""
    if args.fp16:
        return "fp16"
    if args.bf16:
        return "bf16"
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
