"""What a training run writes into its run directory (``RunLayout``), on the rank that writes:
the directory opened (started or resumed, ``rlvr_fast.run.directory``), config.json, one checked
ledger line and one rollouts line per step, checkpoints, the final models and, last,
summary.json. Before each of these writes it checks that it still holds the directory's lock
(``rlvr_fast.utils.locks``): once the lock file was removed or replaced it raises
``LockLostError`` and writes nothing more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from rlvr_fast.data.problems import Problem
from rlvr_fast.ledger.records import LedgerRecord
from rlvr_fast.ledger.writer import LedgerWriter
from rlvr_fast.run.checkpoint import Checkpointer
from rlvr_fast.run.directory import open_run_directory, whole_lines
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.utils.files import append_line, write_json_atomic
from rlvr_fast.utils.locks import DirectoryLock


class RunRecorder:
    def __init__(self, root: Path) -> None:
        self.layout = RunLayout(root)
        self.ledger: LedgerWriter | None = None
        self.lock: DirectoryLock | None = None

    def open(
        self, signature: dict, config: dict, train_data: Sequence[Problem], resume: bool
    ) -> dict | None:
        """Check that the run may start (or resume) here; the recorded config.json when
        resuming, None when starting. Nothing is written when a check fails."""
        recorded, self.lock = open_run_directory(
            self.layout.root, signature, config, train_data, resume
        )
        return recorded

    def check_lock(self) -> None:
        """Raise ``LockLostError`` unless this process still holds the directory's lock."""
        self.lock.check()

    def keep_steps(self, count: int) -> None:
        """Drop the step lines written after the checkpoint a resume continues from."""
        self.check_lock()
        whole_lines(self.layout.ledger, count)
        whole_lines(self.layout.rollouts, count)

    def write_config(self, meta: dict) -> None:
        self.check_lock()
        # summary.json goes first: a kill in between leaves an unfinished run to resume.
        self.layout.summary.unlink(missing_ok=True)
        write_json_atomic(self.layout.config, meta)

    def start_ledger(self) -> None:
        self.ledger = LedgerWriter(self.layout.ledger)

    def write_step(self, record: LedgerRecord, line: dict) -> None:
        self.check_lock()
        self.ledger.write(record)
        self.check_lock()
        append_line(self.layout.rollouts, json.dumps(line))

    def save_checkpoint(
        self, checkpointer: Checkpointer, next_step: int, world_size: int, state=None
    ) -> None:
        self.check_lock()
        checkpointer.save(self.layout.checkpoint, next_step, world_size, state)

    def save_model(self, policy, *, polyak: bool = False, weights=None) -> None:
        self.check_lock()
        policy.save(self.layout.model(polyak), weights)

    def finish(self, summary: dict) -> None:
        self.check_lock()
        write_json_atomic(self.layout.summary, summary)
        self.close()

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()


def finished_summary(layout: RunLayout) -> dict | None:
    """summary.json of a finished run; None when there is none, or one that does not parse (the
    run then finishes again from its last checkpoint and writes it anew)."""
    try:
        summary = json.loads(layout.summary.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return summary if isinstance(summary, dict) else None


def count_active_steps(layout: RunLayout, steps: int) -> int:
    """Steps among the first ``steps`` whole ledger lines that ran a backward pass (tree arms
    bifurcate after a number of them)."""
    if not layout.ledger.exists():
        return 0
    with open(layout.ledger, encoding="utf-8") as file:
        lines = [line for line in file if line.endswith("\n") and line.strip()][:steps]
    return sum(json.loads(line).get("active") is True for line in lines)
