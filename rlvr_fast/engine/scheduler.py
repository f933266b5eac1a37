"""``Scheduler``: continuous batching over a waiting queue and a running list.

Each step is one of:
- a prefill: waiting sequences admitted (up to ``max_batch`` running, the free KV blocks, and
  ``max_prefill_tokens`` padded tokens: the runner pads every row of a pass to its widest, so
  rows join while their number times the widest stays within it; a longer row runs alone)
  whose pending tokens need a multi-token pass (a fresh prompt, or a preempted sequence
  recomputing);
- a decode: every running sequence runs its one pending token (admitted forks of a running
  sequence join here directly: they start with one pending token on top of shared blocks).
Sequences that hold their next logits (forks of a prefilled prompt) are admitted at no cost and
drawn in whichever step comes next. When a decode step has no room for every row's next token,
the most recently admitted sequence is preempted: its blocks are freed and it goes back to the
front of the queue with its tokens, to be recomputed by a prefill. A sequence that cannot fit
even alone is an error, never a silent truncation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.engine.sequence import Sequence, Status


class OutOfBlocksError(ValueError, RuntimeError):
    """The KV cache cannot hold a sequence even with every other one preempted, or cannot be
    made as large as asked; the one-line message names the settings that bound it (a
    ValueError: the settings are what to change)."""


@dataclass
class Batch:
    """One step: ``rows`` run a ``kind`` ("prefill" / "decode") pass whose new tokens go to
    ``slots`` (int64, row after row) after the block ``copies``; ``drawn`` rows only draw their
    next token from the logits they hold."""

    kind: str
    rows: list[Sequence]
    drawn: list[Sequence]
    slots: torch.Tensor | None = None
    copies: list[tuple[int, int]] = field(default_factory=list)


def runs_prefill(seq: Sequence) -> bool:
    """Whether admitting ``seq`` puts it in a prefill pass: pending tokens beyond one, or none
    cached yet."""
    return seq.num_pending > 1 or seq.num_cached == 0


def joins_prefill_pass(rows: int, widest: int, pending: int, max_prefill_tokens: int) -> bool:
    """Whether a prefill pass of ``rows`` rows, the widest ``widest`` tokens, takes one more of
    ``pending`` tokens within ``max_prefill_tokens`` padded tokens (every row runs as wide as
    the widest); a pass of no rows takes any row."""
    return rows == 0 or (rows + 1) * max(widest, pending) <= max_prefill_tokens


class Scheduler:
    def __init__(
        self, manager, counters: EngineCounters, *, max_batch: int, max_prefill_tokens: int
    ) -> None:
        self.manager = manager
        self.counters = counters
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        admitted = self._admit()
        drawn = [seq for seq in admitted if seq.holds_logits]
        prefill = [seq for seq in admitted if runs_prefill(seq)]
        if prefill:
            copies, slots = self.manager.append_many(
                [seq.block_id for seq in prefill], [seq.num_pending for seq in prefill]
            )
            return Batch("prefill", prefill, drawn, slots, copies)
        rows = self._make_room([seq for seq in self.running if seq.num_pending == 1])
        if not rows:
            return Batch("decode", [], drawn)
        copies, slots = self.manager.append_batch([seq.block_id for seq in rows], 1)
        return Batch("decode", rows, drawn, slots.view(-1), copies)

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done: leave the running list; give its blocks back unless it keeps them."""
        seq.status = Status.FINISHED
        self.running.remove(seq)
        if not seq.keep_cache:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        if seq.block_id is not None:
            self.manager.free(seq.block_id)
        seq.block_id, seq.num_cached, seq.logits = None, 0, None

    def abort(self) -> list[Sequence]:
        """Empty both queues (after an error mid-run); returns the sequences that were in them."""
        seqs = list(self.waiting) + self.running
        self.waiting.clear()
        self.running.clear()
        return seqs

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        prefills = widest = reserved = 0
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            pending = seq.num_pending
            prefill = runs_prefill(seq)
            if prefill and not joins_prefill_pass(
                prefills, widest, pending, self.max_prefill_tokens
            ):
                break
            needed = self.blocks_needed(seq)
            free = self.manager.num_free_blocks() - reserved
            if needed > free:
                if not admitted and not self.running:
                    raise OutOfBlocksError(self.no_room_message(seq, needed))
                break
            self.waiting.popleft()
            if seq.block_id is None:
                seq.block_id = self.manager.allocate(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            if prefill:
                prefills, widest = prefills + 1, max(widest, pending)
            reserved += needed
        return admitted

    def blocks_needed(self, seq: Sequence) -> int:
        """Free blocks that running ``seq``'s pending tokens takes."""
        if seq.block_id is None:
            return -(-seq.num_pending // self.manager.block_size)
        return self.manager.blocks_needed([seq.block_id], [seq.num_pending])

    def no_room_message(self, seq: Sequence, needed: int) -> str:
        total = self.manager.num_blocks
        held = total - self.manager.num_free_blocks()
        where = f"; {held} are held by sequences outside this run (free them)" if held else ""
        return (
            f"out of KV blocks: a sequence of {len(seq.token_ids)} tokens needs {needed} more "
            f"blocks of {self.manager.block_size} tokens and the engine has {total}{where}; "
            f"raise kv_blocks or kv_memory_fraction"
        )

    # ------------------------------------------------------------------ decode room
    def _make_room(self, rows: list[Sequence]) -> list[Sequence]:
        """Preempt the most recently admitted rows until every remaining one can take a token."""
        while rows:
            needed = self.manager.blocks_needed([seq.block_id for seq in rows], [1] * len(rows))
            if needed <= self.manager.num_free_blocks():
                return rows
            if len(rows) == 1:
                raise OutOfBlocksError(self.no_room_message(rows[0], needed))
            victim = rows.pop()
            self._preempt(victim)
        return rows

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1
