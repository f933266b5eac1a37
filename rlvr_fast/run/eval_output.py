"""What ``rlvr-fast eval --out DIR`` writes: NAME.jsonl (every item's grade and response) for each
eval set, then summary.json (each set's counts), each file whole, and only once every set is
evaluated: an eval that fails writes nothing.

DIR is new, empty, or one an eval wrote before (its lock file and only these names), and the eval
holds its lock while it runs. Anything else is refused before the model loads: a run directory
(eval's summary.json and NAME.jsonl would replace the run's; its own evaluations are in evals/),
a model directory, any directory holding files an eval does not write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlvr_fast.run.layout import RunLayout
from rlvr_fast.utils.files import is_temp_name, write_json_atomic, write_text_atomic
from rlvr_fast.utils.locks import LOCK_NAME, DirectoryLockedError, lock_directory


class EvalOutputError(ValueError):
    """An --out directory an eval may not write into."""


@dataclass(frozen=True)
class EvalOutput:
    root: Path

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def items(self, name: str) -> Path:
        return self.root / f"{name}.jsonl"

    def check(self) -> None:
        """Refuse, reading only, a DIR this eval may not write into."""
        if self.root.exists() and not self.root.is_dir():
            raise EvalOutputError(f"{self.root}: exists and is not a directory")
        if not self.root.is_dir():
            return
        names = [entry.name for entry in self.root.iterdir()]
        if RunLayout(self.root).config.name in names:
            raise EvalOutputError(
                f"{self.root}: holds config.json (a run or model directory); eval's "
                "summary.json and NAME.jsonl would replace its files: choose a new --out"
            )
        if names and LOCK_NAME not in names:
            raise EvalOutputError(
                f"{self.root}: not empty and not an eval's output (no {LOCK_NAME}); choose a new "
                "or empty --out"
            )
        foreign = sorted(n for n in names if not (self.is_eval_name(n) or is_temp_name(n)))
        if foreign:
            raise EvalOutputError(
                f"{self.root}: holds {foreign[0]!r}, which an eval does not write; choose a new "
                "or empty --out"
            )

    def is_eval_name(self, name: str) -> bool:
        return name in (LOCK_NAME, self.summary.name) or (
            name.endswith(".jsonl") and (self.root / name).is_file()
        )

    def open(self) -> None:
        """Make DIR and hold its lock for the rest of the process (checked again once held: an
        eval that started in between wrote there)."""
        self.check()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock_directory(self.root)
        except DirectoryLockedError as err:
            raise EvalOutputError(str(err)) from None
        self.check()

    def write(self, items: dict[str, list[dict]], summaries: dict[str, dict]) -> None:
        """Each set's items, then summary.json, which names the sets of this eval."""
        for name, lines in items.items():
            write_text_atomic(self.items(name), "".join(json.dumps(i) + "\n" for i in lines))
        write_json_atomic(self.summary, summaries)
