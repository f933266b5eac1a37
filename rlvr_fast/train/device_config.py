"""The settings of the device a run computes on: its precision, sharding, activation
checkpointing and the engine's KV cache (``rlvr_fast.train.memory_plan`` sizes them before
anything is allocated), a component of ``TrainConfig`` (``config.device``). Each is written to
config.json only when set: runs written before it existed keep their config.json."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.train.checkpointing import CHECKPOINTING_ERROR, CHECKPOINTING_HELP, is_checkpointing
from rlvr_fast.train.precision import PRECISIONS
from rlvr_fast.train.sharding import SHARD_ERROR, SHARD_HELP, SHARDINGS
from rlvr_fast.utils.settings import setting

PRECISION_HELP = (
    "fp32; bf16-mixed: bf16 forward and backward, fp32 master weights, gradients and optimizer "
    "state; fp16-mixed: the same in fp16 with a dynamic loss scale (rlvr_fast.train.loss_scale); "
    "bf16-true: bf16 weights stepped directly (the study's recipe); None: bf16-mixed on CUDA, "
    "fp32 elsewhere"
)
PRECISION_ERROR = f"precision must be one of {', '.join(PRECISIONS)} or None, got {{value!r}}"


@dataclass
class DeviceConfig:
    precision: str | None = setting(
        None,
        PRECISION_HELP,
        lambda v: v is None or v in PRECISIONS,
        PRECISION_ERROR,
        written_when_set=True,
    )
    activation_checkpointing: bool | str = setting(
        False, CHECKPOINTING_HELP, is_checkpointing, CHECKPOINTING_ERROR, written_when_set=True
    )
    kv_memory_fraction: float = setting(
        0.5,
        "share of free device memory (available memory on the CPU) the KV cache takes",
        lambda v: 0 < v <= 1,
        "kv_memory_fraction must be in (0, 1], got {value}",
        written_when_set=True,
    )
    kv_blocks: int | None = setting(
        None,
        "KV cache blocks of 16 tokens (None: sized by kv_memory_fraction)",
        lambda v: v is None or v >= 1,
        "kv_blocks must be >= 1 or None, got {value}",
        written_when_set=True,
    )
    max_model_len: int | None = setting(
        None,
        "the longest sequence the engine's CUDA graphs cover (None: the model's, at most "
        "16,384); longer ones decode eagerly",
        lambda v: v is None or v >= 1,
        "max_model_len must be >= 1 or None, got {value}",
        written_when_set=True,
    )
    shard: str | None = setting(
        None, SHARD_HELP, lambda v: v is None or v in SHARDINGS, SHARD_ERROR, written_when_set=True
    )
