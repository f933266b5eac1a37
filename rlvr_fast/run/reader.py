"""A run directory as the trainer writes it, read back.

    RUN/config.json            {"config": TrainConfig fields, "model", "trainable_parameters",
                                "versions", "git_commit"}
    RUN/ledger.jsonl           one checked ledger line per step (``rlvr_fast.ledger.records``)
    RUN/rollouts.jsonl         one line per step: texts, token lengths, rewards, the answer and
                               prompt length, and on tree steps the pairs' prefix lengths,
                               categories, Stage-1 root lengths and Stage-2 token count; on a
                               multi-question step one such line per question under "questions"
                               (so are its ledger line's sub-records: ``question_lines``)
    RUN/evals/NAME.jsonl       per-item grades after training (``evaluation.ItemGrade``)
    RUN/evals/before/NAME.jsonl  the same before training
    RUN/evals/polyak/NAME.jsonl  the same for the Polyak average of the weights (polyak_start)
    RUN/eval_steps.jsonl       with --eval-every: one line per evaluation, its step and each
                               set's summary (the items under evals/step-N/)
    RUN/summary.json           written last: a run that has it is finished

Files are read when first asked for. Anything missing or unreadable raises ``RunDirError`` with
one line naming the file (and line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rlvr_fast.run.directory import MAX_CONFIG_BYTES, MAX_STEP_LOG_BYTES, RUN_KEY
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.utils.files import UnreadableFileError, parse_json, read_text

# What a run's start, model and data are, from config.json's signature (run.directory): runs of
# one arm that differ in any of these are not seeds of one experiment.
SIGNATURE_FIELDS = ("model_sha256", "train_data", "eval_data", "dtype", "device")


class RunDirError(ValueError):
    """A run directory is missing, incomplete or holds a file that does not parse."""


def read_json(path: Path, limit: int = MAX_CONFIG_BYTES):
    """The JSON document in a run file: bounded, a regular file (a FIFO or a link to /dev/zero
    is refused unread), every failure one line naming it."""
    try:
        return parse_json(read_text(path, limit, "run file"), str(path))
    except UnreadableFileError as err:
        raise RunDirError(str(err).replace(": no such file", ": missing", 1)) from None


def read_json_object(path: Path) -> dict:
    value = read_json(path)
    if not isinstance(value, dict):
        raise RunDirError(f"{path}: not a JSON object (a {type(value).__name__})")
    return value


def read_jsonl(path: Path) -> list[dict]:
    try:
        text = read_text(path, MAX_STEP_LOG_BYTES, "run file")
    except UnreadableFileError as err:
        raise RunDirError(str(err).replace(": no such file", ": missing", 1)) from None
    lines = []
    # Lines end at "\n" only (str.splitlines would also split at U+2028 inside a string).
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = parse_json(line, f"{path}:{number}")
        except UnreadableFileError as err:
            raise RunDirError(str(err)) from None
        if not isinstance(value, dict):
            raise RunDirError(f"{path}:{number}: not a JSON object")
        lines.append(value)
    return lines


def is_run_dir(path: Path) -> bool:
    """A directory with a config.json entry (what it holds is checked when it is opened)."""
    return path.is_dir() and os.path.lexists(RunLayout(path).config)


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """Each path is a run directory, or a directory whose sub-directories are (a sweep's
    ``runs/``); the result keeps the order given, sub-directories sorted by name."""
    found = []
    for path in paths:
        if not path.exists():
            raise RunDirError(f"{path}: no such directory")
        if is_run_dir(path):
            found.append(path)
            continue
        children = sorted(p for p in path.iterdir() if is_run_dir(p)) if path.is_dir() else []
        if not children:
            raise RunDirError(f"{path}: not a run directory (no config.json) and holds none")
        found.extend(children)
    if len(set(p.resolve() for p in found)) != len(found):
        raise RunDirError("a run directory is given twice")
    return found


@dataclass
class Run:
    """One run directory: config.json read when opened, the other files on first use."""

    path: Path
    meta: dict
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: Path) -> "Run":
        meta = read_json_object(RunLayout(path).config)
        if not isinstance(meta.get("config"), dict):
            raise RunDirError(f"{path / 'config.json'}: no 'config' object")
        for key, kind in (("arm", str), ("seed", int), ("steps", int)):
            if not isinstance(meta["config"].get(key), kind):
                raise RunDirError(f"{path / 'config.json'}: config has no {kind.__name__} {key!r}")
        return cls(path, meta)

    def _load(self, key: str, reader):
        if key not in self._cache:
            self._cache[key] = reader()
        return self._cache[key]

    @property
    def config(self) -> dict:
        return self.meta["config"]

    @property
    def arm(self) -> str:
        return self.config["arm"]

    @property
    def seed(self) -> int:
        return self.config["seed"]

    @property
    def ledger(self) -> list[dict]:
        return self._load("ledger", lambda: read_jsonl(RunLayout(self.path).ledger))

    @property
    def rollouts(self) -> list[dict]:
        return self._load("rollouts", lambda: read_jsonl(RunLayout(self.path).rollouts))

    @property
    def eval_steps(self) -> list[dict]:
        """eval_steps.jsonl's lines (none for a run without --eval-every)."""
        path = RunLayout(self.path).eval_steps
        return self._load("eval_steps", lambda: read_jsonl(path) if path.exists() else [])

    @property
    def signature(self) -> dict:
        """config.json's run signature (empty for a run written before it had one)."""
        signature = self.meta.get(RUN_KEY)
        return signature if isinstance(signature, dict) else {}

    @property
    def summary(self) -> dict | None:
        """summary.json, a JSON object whose sections are objects; None when absent."""
        path = RunLayout(self.path).summary
        return self._load("summary", lambda: read_summary(path) if self.finished else None)

    @property
    def finished(self) -> bool:
        return os.path.lexists(RunLayout(self.path).summary)

    def eval_files(self, before: bool = False, *, polyak: bool = False) -> dict[str, Path]:
        """NAME -> evals/NAME.jsonl (or evals/before/NAME.jsonl, or evals/polyak/NAME.jsonl),
        sorted by name."""
        directory = RunLayout(self.path).evals(
            "before" if before else "polyak" if polyak else "after"
        )
        return {p.stem: p for p in sorted(directory.glob("*.jsonl"))}

    def evals(self, before: bool = False, *, polyak: bool = False) -> dict[str, list[dict]]:
        """NAME -> per-item grades, in the order they were written."""
        key = "evals_before" if before else "evals_polyak" if polyak else "evals"
        return self._load(
            key,
            lambda: {
                name: read_jsonl(path)
                for name, path in self.eval_files(before, polyak=polyak).items()
            },
        )

    def step_evals(self, step: int) -> dict[str, list[dict]]:
        """NAME -> per-item grades of the evaluation during training after ``step`` steps
        (evals/step-N/, --eval-every); empty when there is none."""
        directory = RunLayout(self.path).evals(f"step-{step}")
        return {p.stem: read_jsonl(p) for p in sorted(directory.glob("*.jsonl"))}


def read_summary(path: Path) -> dict:
    summary = read_json_object(path)
    for key, section in summary.items():
        if key.startswith("eval_") and not (
            isinstance(section, dict) and all(isinstance(v, dict) for v in section.values())
        ):
            raise RunDirError(f"{path}: {key} is not an object of eval sets")
    return summary


def question_lines(line: dict) -> list[dict]:
    """A ledger or rollouts line's per-question lines: its "questions" on a multi-question
    step, else the line itself."""
    return line["questions"] if "questions" in line else [line]


def load_runs(paths: list[Path]) -> list[Run]:
    """The runs under ``paths`` (see ``find_run_dirs``), their config.json read and checked."""
    return [Run.open(path) for path in find_run_dirs(paths)]
