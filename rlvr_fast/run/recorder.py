"""What a training run writes into its run directory (``RunLayout``), on the rank that writes:
the directory opened (started or resumed, ``rlvr_fast.run.directory``), config.json, one checked
ledger line and one rollouts line per step, checkpoints, the final models and, last,
summary.json. Before each of these writes it checks that it still holds the directory's lock
(``rlvr_fast.utils.locks``): once the lock file was removed or replaced it raises
``LockLostError`` and writes nothing more."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

from rlvr_fast.data.problems import Problem
from rlvr_fast.ledger.records import LedgerRecord
from rlvr_fast.ledger.writer import LedgerWriter
from rlvr_fast.run.checkpoint import Checkpointer
from rlvr_fast.run.directory import open_run_directory, sha256_json, whole_lines
from rlvr_fast.run.layout import HF_CHECKPOINT_MARKER, HF_CHECKPOINT_PREFIX, RunLayout
from rlvr_fast.utils.files import (
    append_line,
    replaced_directory,
    write_json_atomic,
    write_text_atomic,
)
from rlvr_fast.utils.locks import DirectoryLock


# What names the run in its checkpoint-N/ markers: the same for a resume and an extension.
RUN_ID_FIELDS = ("arm", "seed", "settings_sha256", "model_sha256")


class RunRecorder:
    def __init__(self, root: Path) -> None:
        self.layout = RunLayout(root)
        self.run_id = ""
        self.ledger: LedgerWriter | None = None
        self.lock: DirectoryLock | None = None

    def open(
        self, signature: dict, config: dict, train_data: Sequence[Problem], resume: bool
    ) -> dict | None:
        """Check that the run may start (or resume) here; the recorded config.json when
        resuming, None when starting. Nothing is written when a check fails."""
        self.run_id = sha256_json({key: signature[key] for key in RUN_ID_FIELDS})[:16]
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

    def save_hf_checkpoint(self, policy, steps: int, weights=None, keep: int | None = None) -> None:
        """checkpoint-``steps``/: a Hugging Face directory of the model after ``steps`` steps
        (swapped in whole), marked as this run's; then, with ``keep``, the run's older ones
        past the newest ``keep`` deleted (a directory another run or a person put there is
        left alone)."""
        self.check_lock()
        with replaced_directory(self.layout.hf_checkpoint(steps)) as staging:
            policy.write_files(staging, weights)
            marker = {"run": self.run_id, "steps": steps}
            (staging / HF_CHECKPOINT_MARKER).write_text(json.dumps(marker) + "\n")
        if keep is not None:
            for old in self.hf_checkpoints()[:-keep]:
                self.check_lock()
                shutil.rmtree(self.layout.hf_checkpoint(old))

    def hf_checkpoints(self) -> list[int]:
        """The steps of the Hugging Face checkpoints this run wrote, in order."""
        steps = []
        for path in self.layout.root.glob(f"{HF_CHECKPOINT_PREFIX}*"):
            number = path.name.removeprefix(HF_CHECKPOINT_PREFIX)
            marker = path / HF_CHECKPOINT_MARKER
            if not number.isdecimal() or path.is_symlink() or not marker.is_file():
                continue
            try:
                recorded = json.loads(marker.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError):
                continue
            if isinstance(recorded, dict) and recorded.get("run") == self.run_id:
                steps.append(int(number))
        return sorted(steps)

    def write_eval_steps(self, steps: int, summaries: dict[str, dict]) -> None:
        """One line of eval_steps.jsonl: the evaluation after ``steps`` steps."""
        self.check_lock()
        append_line(self.layout.eval_steps, json.dumps({"step": steps, "sets": summaries}))

    def keep_eval_steps(self, steps: int) -> None:
        """A resume at ``steps`` drops the evaluations an earlier attempt made after it."""
        path = self.layout.eval_steps
        if not path.is_file():
            return
        self.check_lock()
        lines = path.read_text(encoding="utf-8").split("\n")
        kept = [line for line in lines[:-1] if evaluated_at(line) is not None]
        kept = [line for line in kept if evaluated_at(line) <= steps]
        if kept != lines[:-1] or lines[-1]:
            write_text_atomic(path, "".join(line + "\n" for line in kept))

    def finish(self, summary: dict) -> None:
        self.check_lock()
        write_json_atomic(self.layout.summary, summary)
        self.close()

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()


def evaluated_at(line: str) -> int | None:
    """The step of an eval_steps.jsonl line; None for one that is not whole."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) else None


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
