"""The paged KV cache: storage ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` and
two users of it built on ``rlvr_fast._C.BlockManager``:

- ``PagedKVCache``, the batch sampler's cache (``generate(..., paged=True)``): one sequence per
  batch row, the same interface as the contiguous ``KVCache``;
- ``PagedSequences``, sequences that grow one forward pass at a time and can be forked at any
  length, sharing their prefix blocks: what tree rollouts branch on.

The block manager decides which blocks a sequence owns and where each new token goes (its slot,
block * block_size + offset); ``PagedKVStorage`` holds the tensors, writes tokens into their
slots and performs the block copies copy-on-write asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rlvr_fast.engine.attention import attention
from rlvr_fast.engine.kv_cache import CachePositions
from rlvr_fast.ops.paged_attention import paged_prefill_attention


@dataclass
class AttentionPlan:
    """One forward pass's paged attention inputs, shared by every layer; query (r, t) sees the
    first context_lens[r, t] tokens of row r. Float32 on CPU: the slots of each row's first
    ``width`` tokens [R, width] (one C++ call), which the C++ kernel reads through. Otherwise
    block tables [R, M] int32 for ``paged_prefill_attention`` (Triton, or the torch reference
    for other CPU dtypes)."""

    context_lens: torch.Tensor
    block_tables: torch.Tensor | None = None
    slots: torch.Tensor | None = None


class PagedKVStorage:
    """``use_triton``: attend with the Triton kernels reading blocks in place (the default on
    CUDA); a CPU storage can turn it on to run them under TRITON_INTERPRET=1 (tests do)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.data = torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
                                dtype=dtype, device=device)
        self.use_triton = self.data.is_cuda
        from rlvr_fast._C import paged_attention_cpu  # built with the block manager

        self._cpu_kernel = paged_attention_cpu

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

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Store k, v [N, Hkv, D] at flat cache slots [N] (int64, block * block_size + offset)."""
        shape = (-1,) + tuple(self.data.shape[-2:])
        self.data[layer, 0].view(shape).index_copy_(0, slots, k)
        self.data[layer, 1].view(shape).index_copy_(0, slots, v)

    def plan(self, manager, seq_ids: list[int], context_lens: torch.Tensor,
             lengths: list[int]) -> AttentionPlan:
        """What every layer of one forward pass attends with (see ``AttentionPlan``);
        ``lengths`` are the rows' cached token counts after this pass, as Python ints (so
        planning needs no device sync)."""
        if not self.use_triton and self.data.dtype == torch.float32:
            return AttentionPlan(context_lens, slots=manager.token_slots(seq_ids, max(lengths)))
        # The Triton kernel's block loop bound is a compile-time constant: round the table width
        # up to a power of two so a growing batch compiles a handful of variants, not one per
        # block count (columns past a row's length are never read).
        blocks = -(-max(lengths) // self.block_size)
        tables = manager.block_tables(seq_ids, 1 << max(blocks - 1, 0).bit_length())
        return AttentionPlan(context_lens, block_tables=tables.to(self.data.device))

    def attend(self, layer: int, q: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """q [R, Hq, T, D] against the cached keys of each row; query (r, t) sees the first
        ``plan.context_lens[r, t]`` tokens."""
        if plan.slots is not None:
            return self._cpu_kernel(q, self.keys(layer), self.values(layer), plan.slots,
                                    plan.context_lens)
        return paged_prefill_attention(q, self.keys(layer), self.values(layer),
                                       plan.block_tables, plan.context_lens,
                                       backend="triton" if self.use_triton else "torch",
                                       check=False)


class PagedKVCache(CachePositions):
    """The sampler's cache on paged storage: one BlockManager sequence per batch row.

    Same interface as the contiguous ``KVCache`` (``open_columns`` / ``decode_mask`` /
    ``attend`` / ``advance`` / ``keep_rows``). Prefill attends within the (left-padded) batch and
    stores each row's real tokens in its blocks; each decode step appends one slot per row in one
    ``append_batch`` call (copy-on-write when a forked row shares its partial last block) and runs
    paged attention. A row that leaves the batch frees its blocks at once.
    """

    def __init__(self, config, batch_size: int, capacity: int, *, block_size: int = 16,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        # Imported here so that `import rlvr_fast` works before the C++ extension is built;
        # only the paged caches need it.
        from rlvr_fast._C import BlockManager

        blocks_per_row = -(-capacity // block_size)
        # One spare block per row covers a copy-on-write of a shared partial last block.
        num_blocks = batch_size * (blocks_per_row + 1)
        self.manager = BlockManager(num_blocks, block_size)
        self.storage = PagedKVStorage(config.num_hidden_layers, num_blocks, block_size,
                                      config.num_key_value_heads, config.head_dim, dtype=dtype,
                                      device=device)
        self.device = torch.device(device)
        self.seq_ids: list[int] = []
        self.lengths: list[int] = []
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.next_positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.peak_blocks = 0
        self._slots: torch.Tensor | None = None
        self._prefill_valid: torch.Tensor | None = None
        self._plan: AttentionPlan | None = None

    def open_columns(self, valid: torch.Tensor) -> torch.Tensor:
        """Prefill: allocate each row's prompt tokens; key validity is the batch's own."""
        self.lengths = valid.sum(dim=1).tolist()
        self.seq_ids = [self.manager.allocate(0) for _ in self.lengths]
        # Slots of every real prompt token, row after row: the order of valid's True entries.
        _, slots = self.manager.append_many(self.seq_ids, self.lengths)
        self._slots = slots.to(self.device)
        self.seq_lens = torch.tensor(self.lengths, device=self.device)
        self._track_peak()
        self._prefill_valid = valid
        return valid

    def decode_mask(self) -> None:
        """Decode: one more slot per row (paged attention needs no mask)."""
        copies, slots = self.manager.append_batch(self.seq_ids, 1)
        self.storage.copy_blocks(copies)
        self._slots = slots.view(-1).to(self.device)
        self._prefill_valid = None
        self.seq_lens += 1
        self.lengths = [n + 1 for n in self.lengths]
        self._track_peak()
        self._plan = self.storage.plan(self.manager, self.seq_ids, self.seq_lens[:, None],
                                       self.lengths)
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self._prefill_valid is not None:
            valid = self._prefill_valid
            self.storage.write_slots(layer, self._slots, k.transpose(1, 2)[valid],
                                     v.transpose(1, 2)[valid])
            return attention(q, k, v, mask)
        self.storage.write_slots(layer, self._slots, k[:, :, 0], v[:, :, 0])
        return self.storage.attend(layer, q, self._plan)

    def keep_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for index in set(range(len(self.seq_ids))) - set(keep):
            self.manager.free(self.seq_ids[index])
        self.seq_ids = [self.seq_ids[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self.seq_lens = self.seq_lens.index_select(0, rows)
        self.next_positions = self.next_positions.index_select(0, rows)

    def _track_peak(self) -> None:
        in_use = self.manager.num_blocks - self.manager.num_free_blocks()
        self.peak_blocks = max(self.peak_blocks, in_use)


class PagedSequences:
    """Sequences on one paged KV cache that grow by forward passes of ``model`` and branch.

    ``prefill(seqs, token_lists)`` runs each sequence's new tokens on top of what it already has
    cached (a whole prompt for a fresh sequence, a suffix after a fork) and ``decode(seqs,
    tokens)`` one token per sequence; both return the logits after each sequence's last new
    token [n, V]. ``fork(seq, num_tokens)`` starts a sequence that shares the first
    ``num_tokens`` cached tokens of ``seq``: no prefill, and at most one block copy (its first
    append into a shared partial block). ``free(seq)`` releases a sequence's blocks.

    Counters for the ledger: ``prefill_tokens`` (tokens run by ``prefill``), ``decode_rows``
    (rows run by ``decode``), ``block_copies`` and ``peak_blocks`` (blocks in use at once).
    """

    def __init__(self, model, num_blocks: int, *, block_size: int = 16) -> None:
        from rlvr_fast._C import BlockManager

        config = model.config
        self.model = model
        self.device = model.lm_head.weight.device
        self.manager = BlockManager(num_blocks, block_size)
        self.storage = PagedKVStorage(config.num_hidden_layers, num_blocks, block_size,
                                      config.num_key_value_heads, config.head_dim,
                                      dtype=model.lm_head.weight.dtype, device=self.device)
        self.block_size = block_size
        self.lengths: dict[int, int] = {}
        self.prefill_tokens = self.decode_rows = self.block_copies = self.peak_blocks = 0
        # State of the forward pass in flight, read by ``attend`` (this object is the cache the
        # model's attention layers call) and by the rotary table (``length``).
        self.length = 0
        self._slots = self._valid = self._plan = None

    def new(self) -> int:
        """An empty sequence (prefill it next)."""
        seq = self.manager.allocate(0)
        self.lengths[seq] = 0
        return seq

    def fork(self, seq: int, num_tokens: int | None = None) -> int:
        """A new sequence sharing the first ``num_tokens`` (default all) cached tokens of seq."""
        child = self.manager.fork(seq, -1 if num_tokens is None else num_tokens)
        self.lengths[child] = self.lengths[seq] if num_tokens is None else num_tokens
        return child

    def free(self, seq: int) -> None:
        self.manager.free(seq)
        del self.lengths[seq]

    @torch.inference_mode()
    def prefill(self, seqs: list[int], token_lists: list[list[int]]) -> torch.Tensor:
        if any(not tokens for tokens in token_lists):
            raise ValueError("prefill: every sequence needs at least one new token")
        copies, slots = self.manager.append_many(seqs, [len(t) for t in token_lists])
        self.prefill_tokens += sum(len(tokens) for tokens in token_lists)
        return self._forward(seqs, token_lists, copies, slots)

    @torch.inference_mode()
    def decode(self, seqs: list[int], tokens: list[int]) -> torch.Tensor:
        copies, slots = self.manager.append_batch(seqs, 1)
        self.decode_rows += len(seqs)
        return self._forward(seqs, [[t] for t in tokens], copies, slots.view(-1))

    def _forward(self, seqs, token_lists, copies, slots) -> torch.Tensor:
        self.storage.copy_blocks(copies)
        self.block_copies += len(copies)
        counts = [len(tokens) for tokens in token_lists]
        starts = [self.lengths[seq] for seq in seqs]
        width = max(counts)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            ids[row, :len(tokens)] = torch.tensor(tokens)
        offsets = torch.arange(width)
        count_t = torch.tensor(counts)
        valid = offsets[None, :] < count_t[:, None]
        # Padding queries repeat their row's last position, so every query sees >= 1 key.
        positions = torch.tensor(starts)[:, None] + torch.minimum(offsets[None, :],
                                                                  count_t[:, None] - 1)
        after = [start + count for start, count in zip(starts, counts)]
        # slots: every new token's cache slot, row after row (the order of k[valid] below).
        self._slots = slots.to(self.device)
        self._valid = valid.to(self.device) if width > 1 else None
        self._plan = self.storage.plan(self.manager, seqs, (positions + 1).to(self.device), after)
        positions = positions.to(self.device)
        self.length = max(starts)
        hidden = self.model.model(ids.to(self.device), positions, None, self)
        for seq, count in zip(seqs, counts):
            self.lengths[seq] += count
        in_use = self.manager.num_blocks - self.manager.num_free_blocks()
        self.peak_blocks = max(self.peak_blocks, in_use)
        last = hidden[torch.arange(len(seqs), device=self.device), (count_t - 1).to(self.device)]
        return self.model.lm_head(last)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self._valid is None:
            self.storage.write_slots(layer, self._slots, k[:, :, 0], v[:, :, 0])
        else:
            self.storage.write_slots(layer, self._slots, k.transpose(1, 2)[self._valid],
                                     v.transpose(1, 2)[self._valid])
        return self.storage.attend(layer, q, self._plan)
