"""Every file of a run directory, named once.

config.json                  signature, settings, provenance (``rlvr_fast.run.directory``)
ledger.jsonl                 one checked line per step (``rlvr_fast.ledger``)
rollouts.jsonl               what ``verify`` re-derives each ledger line from
summary.json                 written last: its presence marks a finished run
checkpoint/state.safetensors weights, optimizer, RNG and Polyak state (``rlvr_fast.run.state_file``)
evals/NAME.jsonl             the final evaluation of eval set NAME; evals/before/ and
                             evals/polyak/ hold the evaluation before training and of the
                             Polyak average
final/, final_polyak/        Hugging Face model directories
trace.json                   the profiler's Chrome trace (``--profile N``)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Where each evaluation of a run goes, under evals/.
EVAL_LABELS = {"before": "before", "after": "", "polyak": "polyak"}


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint" / "state.safetensors"

    @property
    def trace(self) -> Path:
        return self.root / "trace.json"

    def evals(self, label: str = "after") -> Path:
        """The directory of evaluation ``label`` (before, after, polyak)."""
        return self.root / "evals" / EVAL_LABELS[label]

    def eval_file(self, name: str, label: str = "after") -> Path:
        return self.evals(label) / f"{name}.jsonl"

    def model(self, polyak: bool = False) -> Path:
        """The final model directory (or the Polyak average's)."""
        return self.root / ("final_polyak" if polyak else "final")
