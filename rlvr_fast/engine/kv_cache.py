"""Contiguous per-row KV cache for batched decoding of left-padded prompts.

Storage is ``[layers, batch, kv_heads, capacity, head_dim]`` for keys and values, preallocated so
a decode step writes one column in place. All rows share the column index (prompts are
left-padded to one width), and ``valid`` marks which columns of each row hold real tokens.
``keep_rows`` compacts the batch when rows finish, so finished rows cost no further decode work.
The paged cache with fork / copy-on-write lives beside this one in the paged-KV work.
"""

from __future__ import annotations

import torch

from rlvr_fast.engine.attention import attention
from rlvr_fast.models.config import ModelConfig


class CachePositions:
    """What both caches track for RoPE: columns written so far (``length``, an upper bound on
    every position) and each row's next position."""

    length: int
    next_positions: torch.Tensor

    def advance(self, num_tokens: int, next_positions: torch.Tensor | None = None) -> None:
        self.length += num_tokens
        if next_positions is None:
            self.next_positions += num_tokens
        else:
            self.next_positions = next_positions


class KVCache(CachePositions):
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.next_positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.padded = False

    @classmethod
    def for_model(cls, config: ModelConfig, batch_size: int, capacity: int, *,
                  dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        return cls(config.num_hidden_layers, batch_size, config.num_key_value_heads,
                   config.head_dim, capacity, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def open_columns(self, valid: torch.Tensor) -> torch.Tensor:
        """Mark the next ``valid.shape[1]`` columns; return key validity [B, length + new]."""
        end = self._check_room(valid.shape[1])
        self.valid[:, self.length:end] = valid
        # One sync per prefill; it lets unpadded batches (a GRPO group) decode without a mask.
        self.padded = self.padded or not bool(valid.all())
        return self.valid[:, :end]

    def decode_mask(self) -> torch.Tensor | None:
        """Attention mask [B, 1, 1, length + 1] for one decode step; None when no row is padded."""
        end = self._check_room(1)
        if not self.padded:
            return None
        self.valid[:, self.length] = True
        return self.valid[:, None, None, :end]

    def _check_room(self, num_tokens: int) -> int:
        end = self.length + num_tokens
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} columns needed, capacity {self.capacity}")
        return end

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, D] at the open columns; return all keys/values so far."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Store this step's k, v and attend over everything cached so far."""
        k, v = self.write(layer, k, v)
        return attention(q, k, v, mask)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (int64 indices, in the order to keep)."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.valid = self.valid.index_select(0, rows)
        self.next_positions = self.next_positions.index_select(0, rows)
