"""The paged KV cache: storage ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` and
the sampler-facing cache built on ``rlvr_fast._C.BlockManager``.

The block manager decides which blocks a sequence owns; ``PagedKVStorage`` holds the tensors,
writes tokens into their slots and performs the block copies copy-on-write asks for.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlvr_fast.engine.attention import attention
from rlvr_fast.engine.kv_cache import CachePositions
from rlvr_fast.ops.paged_attention import paged_attention


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


class PagedKVCache(CachePositions):
    """The sampler's cache on paged storage: one BlockManager sequence per batch row.

    Same interface as the contiguous ``KVCache`` (``open_columns`` / ``decode_mask`` /
    ``attend`` / ``advance`` / ``keep_rows``). Prefill attends within the (left-padded) batch and
    stores each row's real tokens in its blocks; each decode step appends one slot per row
    (copy-on-write when a forked row shares its partial last block) and runs paged attention.
    A row that leaves the batch frees its blocks at once.
    """

    def __init__(self, config, batch_size: int, capacity: int, *, block_size: int = 16,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        # Imported here so that `import rlvr_fast` works before the C++ extension is built;
        # only the paged cache needs it.
        from rlvr_fast._C import BlockManager

        blocks_per_row = -(-capacity // block_size)
        # One spare block per row covers a copy-on-write of a shared partial last block.
        num_blocks = batch_size * (blocks_per_row + 1)
        self.manager = BlockManager(num_blocks, block_size)
        self.storage = PagedKVStorage(config.num_hidden_layers, num_blocks, block_size,
                                      config.num_key_value_heads, config.head_dim, dtype=dtype,
                                      device=device)
        self.device = torch.device(device)
        self.block_size = block_size
        self.seq_ids: list[int] = []
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.next_positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(batch_size, 0, dtype=torch.int32, device=device)
        self.length = 0
        self.peak_blocks = 0
        self._lengths: list[int] = []
        self._prefill_columns: list[torch.Tensor] | None = None

    def open_columns(self, valid: torch.Tensor) -> torch.Tensor:
        """Prefill: allocate each row's prompt tokens; key validity is the batch's own."""
        self._prefill_columns = [row.nonzero().squeeze(1) for row in valid]
        self.seq_ids = [self.manager.allocate(len(c)) for c in self._prefill_columns]
        self._lengths = [len(c) for c in self._prefill_columns]
        self.seq_lens = torch.tensor(self._lengths, device=self.device)
        self._refresh_tables()
        return valid

    def decode_mask(self) -> None:
        """Decode: one more slot per row (paged attention needs no mask)."""
        copies = [copy for seq in self.seq_ids for copy in self.manager.append(seq, 1)]
        self.storage.copy_blocks(copies)
        self.seq_lens += 1
        self._prefill_columns = None
        # Block tables change only when a row starts a new block or copied its last one.
        self._lengths = [n + 1 for n in self._lengths]
        if copies or any((n - 1) % self.block_size == 0 for n in self._lengths):
            self._refresh_tables()
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self._prefill_columns is not None:
            for row, columns in enumerate(self._prefill_columns):
                positions = torch.arange(len(columns), device=self.device)
                self.storage.write(layer, self.block_tables[row], positions,
                                   k[row, :, columns].transpose(0, 1),
                                   v[row, :, columns].transpose(0, 1))
            return attention(q, k, v, mask)
        positions = self.seq_lens - 1
        rows = torch.arange(len(self.seq_ids), device=self.device)
        blocks = self.block_tables[rows, positions // self.block_size].long()
        offsets = positions % self.block_size
        self.storage.data[layer, 0, blocks, offsets] = k[:, :, 0]
        self.storage.data[layer, 1, blocks, offsets] = v[:, :, 0]
        out = paged_attention(q[:, :, 0], self.storage.keys(layer), self.storage.values(layer),
                              self.block_tables, self.seq_lens, check=False)
        return out.unsqueeze(2)

    def keep_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for index in set(range(len(self.seq_ids))) - set(keep):
            self.manager.free(self.seq_ids[index])
        self.seq_ids = [self.seq_ids[i] for i in keep]
        self._lengths = [self._lengths[i] for i in keep]
        self.seq_lens = self.seq_lens.index_select(0, rows)
        self.next_positions = self.next_positions.index_select(0, rows)
        self.block_tables = self.block_tables.index_select(0, rows)

    def _refresh_tables(self) -> None:
        tables = [self.manager.block_table(seq) for seq in self.seq_ids]
        width = max(len(t) for t in tables)
        self.block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
        for row, table in enumerate(tables):
            self.block_tables[row, :len(table)] = table
        self.block_tables = self.block_tables.to(self.device)
        in_use = self.manager.num_blocks - self.manager.num_free_blocks()
        self.peak_blocks = max(self.peak_blocks, in_use)
