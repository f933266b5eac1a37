"""``Sequence``: one token stream in the rollout engine.

A sequence starts from ``add`` (a prompt) or ``fork`` (a prefix of another sequence); its
completion is what the engine appends after that start. ``num_cached`` tokens have their keys and
values in the paged cache (in the blocks of BlockManager sequence ``block_id``); the rest are
pending and run in the sequence's next pass. A sequence whose every token is cached may hold the
``logits`` of its next token (a prompt prefilled for forking): its next token is drawn from them
with no pass at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

FINISH_EOS = "eos"
FINISH_CAP = "cap"
FINISH_STOP = "stop"

# (tokens generated so far, the last token) -> stop here; the planner's own stopping rule.
StopRule = Callable[[int, int], bool]


class Status(Enum):
    IDLE = "idle"  # added or forked, not in a run
    WAITING = "waiting"  # in a run, not admitted (or preempted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``seed``: the sequence's sampling stream (None: drawn when a run starts);
    ``max_new_tokens``: its own cap (None: the run's); ``stop``: an extra stopping rule;
    ``keep_cache``: keep the blocks after finishing (a planner forks it later)."""

    token_ids: list[int]
    start: int
    seed: int | None = None
    max_new_tokens: int | None = None
    stop: StopRule | None = None
    keep_cache: bool = False
    num_cached: int = 0
    block_id: int | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)
    status: Status = Status.IDLE
    finish_reason: str | None = None

    @property
    def completion(self) -> list[int]:
        return self.token_ids[self.start :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.start

    @property
    def num_pending(self) -> int:
        """Tokens that the sequence's next pass must run (0 when it holds its next logits)."""
        return len(self.token_ids) - self.num_cached

    @property
    def holds_logits(self) -> bool:
        return self.logits is not None and self.num_pending == 0
