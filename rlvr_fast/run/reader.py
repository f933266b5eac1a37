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
    RUN/summary.json           written last: a run that has it is finished

Files are read when first asked for. Anything missing or unreadable raises ``RunDirError`` with
one line naming the file (and line).
"""

from __future__ import annotations

from rlvr_fast.run.layout import RunLayout
import json
from dataclasses import dataclass, field
from pathlib import Path


class RunDirError(ValueError):
    """A run directory is missing, incomplete or holds a file that does not parse."""


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path}: not JSON ({err})") from None
    except RecursionError:
        raise RunDirError(f"{path}: JSON nested too deeply") from None


def read_jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing") from None
    except UnicodeDecodeError as err:
        raise RunDirError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise RunDirError(f"{path}:{number}: not JSON ({err.msg})") from None
        except RecursionError:
            raise RunDirError(f"{path}:{number}: JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise RunDirError(f"{path}:{number}: not a JSON object")
        lines.append(value)
    return lines


def is_run_dir(path: Path) -> bool:
    return RunLayout(path).config.is_file()


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
        meta = read_json(RunLayout(path).config)
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
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
    def summary(self) -> dict | None:
        path = RunLayout(self.path).summary
        return self._load("summary", lambda: read_json(path) if path.exists() else None)

    @property
    def finished(self) -> bool:
        return RunLayout(self.path).summary.is_file()

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


def question_lines(line: dict) -> list[dict]:
    """A ledger or rollouts line's per-question lines: its "questions" on a multi-question
    step, else the line itself."""
    return line["questions"] if "questions" in line else [line]


def load_runs(paths: list[Path]) -> list[Run]:
    """The runs under ``paths`` (see ``find_run_dirs``), their config.json read and checked."""
    return [Run.open(path) for path in find_run_dirs(paths)]
