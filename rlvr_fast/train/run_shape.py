"""The run settings the memory plan reads (``rlvr_fast.train.memory_plan``), by TrainConfig's
names, checked as they are made."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.models.lora import LoraSettings
from rlvr_fast.train.memory_terms import ADAMW_STEPS, PRECISIONS
from rlvr_fast.train.stepping import OPTIMIZERS

# The counts of a run shape, each at most 2^40: past that the plan's float arithmetic overflows
# (a 401-digit --group-size) long before any device could hold it.
COUNTS = (
    "group_size",
    "questions_per_step",
    "prompt_tokens",
    "max_new_tokens",
    "max_batch",
    "kv_blocks",
    "max_model_len",
    "block_size",
    "loss_chunk_tokens",
)
MAX_COUNT = 1 << 40


@dataclass(frozen=True)
class RunShape:
    """The run settings the plan reads (TrainConfig's names)."""

    precision: str = "bf16-mixed"
    group_size: int = 8
    questions_per_step: int = 1
    prompt_tokens: int = 200
    max_new_tokens: int = 512
    max_batch: int = 256
    activation_checkpointing: bool | int = False  # every layer, none, or the first that many
    kv_memory_fraction: float = 0.9
    kv_blocks: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    loss_chunk_tokens: int | None = None
    eager_loss: bool = False
    untied: bool = False
    cuda_graphs: bool = True
    reference_model: bool = False
    lora: LoraSettings | None = None
    adamw_step: str = "foreach"
    optimizer: str = "adamw"
    shard: str | None = None  # "fsdp": one rank of world_size (rlvr_fast.train.memory_sharded)
    world_size: int = 1

    def __post_init__(self) -> None:
        checks = [
            (self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}"),
            (self.adamw_step in ADAMW_STEPS, f"adamw_step must be one of {', '.join(ADAMW_STEPS)}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}"),
            (self.group_size >= 1, "group_size must be >= 1"),
            (self.shard is None or self.world_size >= 2, "shard fsdp needs --nproc N >= 2"),
            (self.questions_per_step >= 1, "questions_per_step must be >= 1"),
            (self.prompt_tokens >= 1, "prompt_tokens must be >= 1"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.max_batch >= 1, "max_batch must be >= 1"),
            (0 < self.kv_memory_fraction <= 1, "kv_memory_fraction must be in (0, 1]"),
            (self.kv_blocks is None or self.kv_blocks >= 1, "kv_blocks must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (
                self.loss_chunk_tokens is None or self.loss_chunk_tokens >= 1,
                "loss_chunk_tokens must be >= 1",
            ),
        ]
        for name in COUNTS:
            value = getattr(self, name)
            if value is not None and value > MAX_COUNT:
                digits = len(str(value))
                got = f"{value:,}" if digits <= 20 else f"a number of {digits} digits"
                checks.append((False, f"{name} must be at most {MAX_COUNT:,}, got {got}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(f"memory plan: {message}")

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def backward_tokens(self) -> int:
        """The largest backward: one question's G rows, right-padded to the longest."""
        return self.group_size * self.row_tokens
