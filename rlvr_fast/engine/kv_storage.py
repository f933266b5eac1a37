"""The paged KV cache tensor and how many blocks it gets.

Storage is ``[layers, 2, capacity + 1, block_size, kv_heads, head_dim]`` (keys, values). The
C++ ``BlockManager`` hands out blocks 0 .. num_blocks - 1; the extra last block is scratch: the
padding tokens of a pass write there and the padded rows of a CUDA-graph batch read it, so no
pass ever needs a mask to keep padding out of a real sequence's blocks.

On CUDA the storage holds every block from the start (``capacity == num_blocks``: the decode
graphs capture its address). On the CPU it is sized by the run's need: it starts small and
doubles, up to ``num_blocks``, whenever a pass is about to write a block past its end
(``reserve``), so a run holds what its longest batch used, not a share of the machine's memory
(2.1 GB for the 886k-parameter tiny model before). A growth that finds no memory is a one-line
``OutOfBlocksError`` naming the settings that bound it.
"""

from __future__ import annotations

import os

import torch

from rlvr_fast.engine.scheduler import OutOfBlocksError
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.context import LayerCache

# Blocks a growable (CPU) storage starts with: 64 blocks of 16 tokens, a 1,024-token row.
INITIAL_CPU_BLOCKS = 64


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


def free_memory(device: torch.device) -> int:
    """Bytes free for the engine: the device's free memory on CUDA, the machine's available
    memory on a CPU (where pages are only committed as blocks are used)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory(device: torch.device) -> int:
    """The device's whole memory: the GPU's, or the machine's physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits_device(
    config: ModelConfig, kv_blocks: int, block_size: int, dtype: torch.dtype, device
) -> None:
    """``kv_blocks`` asked for explicitly: refused when the full cache would not fit in the
    device's whole memory (it could never be used, and the block manager alone takes 8 bytes
    a block)."""
    need = kv_blocks * bytes_per_block(config, block_size, dtype)
    have = device_memory(torch.device(device))
    if need > have:
        raise OutOfBlocksError(
            f"kv_blocks={kv_blocks:,} needs {need / 2**30:,.1f} GiB of KV cache, more than the "
            f"{have / 2**30:,.1f} GiB of memory on {device}"
        )


class PagedKVStorage:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        growable: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.block_shape = (block_size, config.num_key_value_heads, config.head_dim)
        self.num_layers = config.num_hidden_layers
        self.block_bytes = bytes_per_block(config, block_size, dtype)
        self.capacity = 0
        self.data = torch.empty(0)
        self.layers: list[LayerCache] = []
        self._allocate(min(num_blocks, INITIAL_CPU_BLOCKS) if growable else num_blocks)

    def reserve(self, blocks: int) -> None:
        """Make blocks 0 .. ``blocks`` - 1 writable (a no-op when they are): the storage grows
        to at least twice its size, at most ``num_blocks``, keeping what the blocks hold."""
        if blocks <= self.capacity:
            return
        if blocks > self.num_blocks:
            raise ValueError(f"reserve: block {blocks - 1} is past the {self.num_blocks} blocks")
        self._allocate(min(self.num_blocks, max(blocks, 2 * self.capacity)))

    def _allocate(self, capacity: int) -> None:
        shape = (self.num_layers, 2, capacity + 1, *self.block_shape)
        try:
            data = torch.empty(shape, dtype=self.dtype, device=self.device)
        except (MemoryError, RuntimeError) as err:
            raise OutOfBlocksError(
                f"KV cache: no memory for {capacity:,} blocks "
                f"({capacity * self.block_bytes / 2**20:,.0f} MiB) on {self.device} "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                "lower max_batch, or bound the cache with kv_blocks or kv_memory_fraction"
            ) from None
        if self.capacity:
            data[:, :, : self.capacity] = self.data[:, :, : self.capacity]
        data[:, :, capacity].zero_()
        self.data, self.capacity = data, capacity
        slots_shape = (-1,) + tuple(data.shape[-2:])
        self.layers = [
            LayerCache(keys, values, keys.view(slots_shape), values.view(slots_shape))
            for keys, values in zip(data[:, 0], data[:, 1])
        ]

    @property
    def scratch_block(self) -> int:
        return self.capacity

    @property
    def scratch_slot(self) -> int:
        return self.capacity * self.block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy every layer's keys and values of block src into block dst, for each (src, dst)
        copy-on-write asked for, before the pass writes into dst."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.data.device)
        dst = torch.tensor([d for _, d in copies], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
