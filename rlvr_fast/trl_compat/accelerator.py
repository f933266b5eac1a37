"""``trainer.accelerator``: the attributes of ``accelerate.Accelerator`` that TRL scripts read,
over rlvr_fast's data parallel (``rlvr_fast.train.distributed``: torchrun, one process per
device, rank 0 writing)."""

from __future__ import annotations

import torch

from rlvr_fast.train import distributed


class Accelerator:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def num_processes(self) -> int:
        return distributed.world_size()

    @property
    def process_index(self) -> int:
        return distributed.rank()

    @property
    def local_process_index(self) -> int:
        return distributed.rank()

    @property
    def is_main_process(self) -> bool:
        return distributed.is_main()

    @property
    def is_local_main_process(self) -> bool:
        return distributed.is_main()

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        distributed.barrier("wait_for_everyone")

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The model itself: rlvr_fast wraps no model (no DDP, no compile)."""
        return model

    def end_training(self) -> None:
        """Destroy the process group of a launched run (trackers end with ``on_train_end``)."""
        if distributed.launched():
            distributed.shutdown()
