"""The paged KV cache tensor and how many blocks it gets.

Storage is ``[layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]`` (keys, values). The
C++ ``BlockManager`` hands out blocks 0 .. num_blocks - 1; the extra last block is scratch: the
padding tokens of a pass write there and the padded rows of a CUDA-graph batch read it, so no
pass ever needs a mask to keep padding out of a real sequence's blocks.
"""

from __future__ import annotations

import os

import torch

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.context import LayerCache


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return (
        config.num_hidden_layers
        * 2
        * block_size
        * config.num_key_value_heads
        * config.head_dim
        * element
    )


def memory_budget(device: torch.device, fraction: float) -> int:
    """Bytes the KV cache may take: ``fraction`` of the device's free memory on CUDA, of the
    machine's available memory on CPU (where pages are only committed as blocks are used)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * fraction)


def plan_num_blocks(
    config: ModelConfig,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    fraction: float,
    most: int,
) -> int:
    """Blocks that fit the budget, at most ``most`` (what the engine could ever hold at once)."""
    fits = memory_budget(device, fraction) // bytes_per_block(config, block_size, dtype)
    if fits < 1:
        raise RuntimeError(
            f"no room for a single KV block on {device} (kv_memory_fraction "
            f"{fraction}); free memory or pass kv_blocks"
        )
    return int(min(fits, most))


class PagedKVStorage:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.empty(
            (
                config.num_hidden_layers,
                2,
                num_blocks + 1,
                block_size,
                config.num_key_value_heads,
                config.head_dim,
            ),
            dtype=dtype,
            device=device,
        )
        self.data[:, :, num_blocks].zero_()
        slots_shape = (-1,) + tuple(self.data.shape[-2:])
        self.layers = [
            LayerCache(keys, values, keys.view(slots_shape), values.view(slots_shape))
            for keys, values in zip(self.data[:, 0], self.data[:, 1])
        ]

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy every layer's keys and values of block src into block dst, for each (src, dst)
        copy-on-write asked for, before the pass writes into dst."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.data.device)
        dst = torch.tensor([d for _, d in copies], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
