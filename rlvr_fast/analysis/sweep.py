"""``rlvr-fast sweep``: train a grid of arms x seeds one run after another, then compare and
report.

    OUT/runs/ARM_sSEED/   one run directory per arm and seed
    OUT/compare.md        the compare tables (also compare.csv and compare.json)
    OUT/report/           the report's figures and report.md

Every run trains on the same problems and is evaluated on the same eval sets; only the arm and
the seed change. Running the same command again picks up where it stopped: a run with
summary.json is finished and left as it is, one with a checkpoint resumes from it, one killed
before its first checkpoint starts over. A run directory recording other settings, another
model or other data than the sweep would use (its signature, ``rlvr_fast.run.directory``) is
refused before anything trains, so a rerun never reprints old tables for new settings.

OUT is new, empty, or a sweep's own (only the entries above): the sweep holds its lock while
it runs, so a second sweep on it is refused with the first one's pid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

from rlvr_fast.run.layout import RunLayout
from rlvr_fast.analysis.compare import compare_runs
from rlvr_fast.analysis.report import publish_report
from rlvr_fast.analysis.verify import UnverifiedRunError, verified_runs
from rlvr_fast.run.reader import Run, RunDirError, is_run_dir, load_runs
from rlvr_fast.analysis.tables import FORMATS, render
from rlvr_fast.data.problems import Problem
from rlvr_fast.run.directory import RunDirectoryError, check_signature, read_run_meta, run_signature
from rlvr_fast.utils.files import is_temp_name, write_text_atomic
from rlvr_fast.utils.locks import LOCK_NAME, DirectoryLockedError, lock_directory
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig


class SweepError(ValueError):
    """A sweep that cannot start: bad grid, or a run directory holding other settings."""


@dataclass(frozen=True)
class SweepRun:
    config: TrainConfig
    path: Path

    @property
    def finished(self) -> bool:
        return RunLayout(self.path).summary.is_file()


def plan_sweep(arms: Sequence[str], seeds: Sequence[int], out: Path, **settings) -> list[SweepRun]:
    """One run per (arm, seed), arm-major, each ``TrainConfig.from_arm(arm, seed=seed,
    **settings)``; refuses duplicates and run directories whose config.json differs."""
    if not arms or not seeds:
        raise SweepError("a sweep needs at least one arm and one seed")
    for kind, values in (("arm", arms), ("seed", seeds)):
        if len(set(values)) != len(values):
            raise SweepError(f"an {kind} is listed twice: {', '.join(map(str, values))}")
    plan = [
        SweepRun(TrainConfig.from_arm(arm, seed=seed, **settings), out / "runs" / f"{arm}_s{seed}")
        for arm in arms
        for seed in seeds
    ]
    for run in plan:
        check_recorded_settings(run)
    return plan


def check_recorded_settings(run: SweepRun) -> None:
    if not RunLayout(run.path).config.is_file():
        return
    try:
        recorded = Run.open(run.path).config
    except RunDirError as err:
        raise SweepError(str(err)) from None
    wanted = json.loads(json.dumps(run.config.to_json()))
    differing = [
        key for key in sorted(set(recorded) | set(wanted)) if recorded.get(key) != wanted.get(key)
    ]
    if differing:
        key = differing[0]
        raise SweepError(
            f"{run.path} was trained with {key}={recorded.get(key)!r}, this sweep "
            f"asks for {key}={wanted.get(key)!r} (use another --out)"
        )


SWEEP_ENTRIES = ("runs", "compare.md", "compare.csv", "compare.json", "report", LOCK_NAME)


def open_sweep_directory(out: Path) -> None:
    """Make OUT, or take an empty one or a sweep's own, and hold its lock for the sweep."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"{out}: exists and is not a directory")
    names = [e.name for e in out.iterdir()] if out.is_dir() else []
    if names and LOCK_NAME not in names:
        # A sweep takes its lock first: without it, compare.md or runs/ are someone else's.
        raise SweepError(
            f"{out}: not a sweep's directory (no {LOCK_NAME}; it holds {sorted(names)[0]!r}); "
            "choose a new or empty --out"
        )
    if names:
        foreign = [n for n in names if n not in SWEEP_ENTRIES and not is_temp_name(n)]
        if foreign:
            raise SweepError(
                f"{out}: holds {sorted(foreign)[0]!r}, which a sweep does not write; choose a new "
                "or empty --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock_directory(out)
    except DirectoryLockedError as err:
        raise SweepError(str(err)) from None


def check_recorded_starts(
    plan: list[SweepRun],
    train_data: Sequence[Problem],
    eval_sets: dict[str, Sequence[Problem]],
    load_policy: Callable[[], object],
) -> None:
    """The run directories already there started from this sweep's model and data (finished
    ones included: they are not trained again, so nothing else would look)."""
    started = [run for run in plan if is_run_dir(run.path)]
    if not started:
        return
    policy = load_policy()
    for run in started:
        config = json.loads(json.dumps(run.config.to_json()))
        meta = read_run_meta(run.path)
        if meta is None:
            raise SweepError(f"{run.path}: not a run directory with a signature; use another --out")
        signature = run_signature(config, policy, train_data, eval_sets)
        try:
            check_signature(run.path, meta, signature, config, train_data)
        except RunDirectoryError as err:
            raise SweepError(f"{err} (this sweep's settings; use another --out)") from None


def run_sweep(
    plan: list[SweepRun],
    out: Path,
    train_data: Sequence[Problem],
    eval_sets: dict[str, Sequence[Problem]],
    load_policy: Callable[[], object],
    *,
    reference: str | None = None,
    progress: bool = True,
) -> str:
    """Train every unfinished run of ``plan`` (a fresh policy from ``load_policy`` each), then
    write OUT/compare.{md,csv,json} and OUT/report/; returns the Markdown tables."""
    if not eval_sets:
        raise SweepError("a sweep needs at least one --eval set to compare the arms on")
    open_sweep_directory(out)
    check_recorded_starts(plan, train_data, eval_sets, load_policy)
    done = sum(run.finished for run in plan)
    with tqdm(total=len(plan), initial=done, desc="sweep", unit="run", disable=not progress) as bar:
        for run in plan:
            if run.finished:
                continue
            bar.set_postfix_str(f"{run.config.arm} seed {run.config.seed}")
            started = time.perf_counter()
            trainer = RLVRTrainer(
                load_policy(),
                run.config,
                train_data,
                eval_sets,
                out_dir=run.path,
                resume=is_run_dir(run.path),
                progress=False,
            )
            trainer.train()
            bar.write(f"{run.path}: trained in {time.perf_counter() - started:.0f} s")
            bar.update()
    # The sweep's own runs pass verify before their tables are written.
    try:
        verified_runs([run.path for run in plan])
    except UnverifiedRunError as err:
        raise SweepError(str(err).split("; see rlvr-fast verify")[0]) from None
    runs = load_runs([run.path for run in plan])
    comparison = compare_runs(runs, reference=reference)
    for fmt in FORMATS:
        write_text_atomic(out / f"compare.{fmt}", render(comparison, fmt))
    publish_report(runs, comparison, out / "report")
    return render(comparison, "md")
