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
checkpoint-N/                a Hugging Face model directory after N steps (``--save-every``),
                             with rlvr_fast_checkpoint.json naming the run that wrote it
evals/step-N/NAME.jsonl      an evaluation during training, after N steps (``--eval-every``);
eval_steps.jsonl             one line per evaluation of such a run: before, during, after
tensorboard/, wandb/         the loggers' files (``--report-to``)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Where each evaluation of a run goes, under evals/.
EVAL_LABELS = {"before": "before", "after": "", "polyak": "polyak"}
HF_CHECKPOINT_PREFIX = "checkpoint-"
# In each checkpoint-N/: the run that wrote it (only those a run wrote are its to delete).
HF_CHECKPOINT_MARKER = "rlvr_fast_checkpoint.json"


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
        """The directory of evaluation ``label`` (before, after, polyak, or step-N: during
        training, after N steps)."""
        return self.root / "evals" / (label if label.startswith("step-") else EVAL_LABELS[label])

    def eval_file(self, name: str, label: str = "after") -> Path:
        return self.evals(label) / f"{name}.jsonl"

    @property
    def eval_steps(self) -> Path:
        return self.root / "eval_steps.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def hf_checkpoint(self, steps: int) -> Path:
        """The Hugging Face checkpoint after ``steps`` steps."""
        return self.root / f"{HF_CHECKPOINT_PREFIX}{steps}"

    def model(self, polyak: bool = False) -> Path:
        """The final model directory (or the Polyak average's)."""
        return self.root / ("final_polyak" if polyak else "final")
