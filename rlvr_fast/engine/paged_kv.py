"""KV storage for the paged cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

Blocks are handed out by ``rlvr_fast._C.BlockManager``; this class only holds the tensors, writes
new tokens into their slots and performs the block copies that copy-on-write asks for.
"""

from __future__ import annotations

from typing import Sequence

import torch


class PagedKVStorage:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.data = torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
                                dtype=dtype, device=device)

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's K and V of block src into block dst, for each (src, dst)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.data.device)
        dst = torch.tensor([d for _, d in copies], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]

    def write(self, layer: int, block_table: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of one sequence at token positions [T] (int64)."""
        blocks = block_table.to(positions.device).long()[positions // self.block_size]
        offsets = positions % self.block_size
        self.data[layer, 0, blocks, offsets] = k
        self.data[layer, 1, blocks, offsets] = v
