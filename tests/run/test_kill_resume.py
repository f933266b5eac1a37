"""A run killed at any moment resumes to the same bytes: real `rlvr-fast train` processes are
SIGKILLed at random moments (twice per trial: the run, then its first resume), resumed with
--resume until they finish, and compared with an uninterrupted run: final weights, ledger (less
timings), rollouts, evaluations and checkpoint byte for byte, and no temp file left behind.

CI runs KILL_TRIALS=2 trials on the embedded tiny model (three steps, a checkpoint after each);
``RLVR_KILL_TRIALS=25 pytest tests/run/test_kill_resume.py -s`` is the longer probe (it prints where
each kill fell).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlvr_fast.run.state_file import load_state
from rlvr_fast.utils.locks import LOCK_NAME

KILL_TRIALS = int(os.environ.get("RLVR_KILL_TRIALS", "2"))
TRAIN = [
    "train",
    "--arm",
    "zg_flat",
    "--steps",
    "3",
    "--seed",
    "5",
    "--quiet",
    "--train-data",
    "synthetic:train:3",
    "--eval",
    "t=synthetic:test:2",
    "--set",
    "max_new_tokens=16",
    "--set",
    "eval_max_new_tokens=16",
    "--set",
    "lr=1e-4",
    "--set",
    "checkpoint_every=1",
]


def command(out: Path, resume: bool) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlvr_fast.cli",
        *TRAIN,
        "--out",
        str(out),
        *(["--resume"] if resume else []),
    ]


def environment() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}",
    }


def run_to_the_end(out: Path, resume: bool) -> None:
    done = subprocess.run(
        command(out, resume), env=environment(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr


def snapshot(out: Path) -> tuple | None:
    """What the run directory holds: every path with its size."""
    entries = []
    for directory, _, files in os.walk(out):  # the run renames and removes files meanwhile
        for name in files:
            with contextlib.suppress(OSError):
                entries.append((directory, name, os.stat(os.path.join(directory, name)).st_size))
    return tuple(sorted(entries)) if out.exists() else None


def watch(process: subprocess.Popen, out: Path, changes: float, delay: float) -> bool:
    """Poll ``out`` until it has changed ``changes`` times, then wait ``delay`` seconds and
    SIGKILL the process; False if it ended first."""
    seen, count = snapshot(out), 0
    while process.poll() is None:
        now = snapshot(out)
        if now != seen:
            seen, count = now, count + 1
            if count >= changes:
                time.sleep(delay)
                if process.poll() is not None:
                    break
                process.send_signal(signal.SIGKILL)
                process.wait()
                return True
        time.sleep(0.002)
    return False


def start(out: Path, resume: bool) -> subprocess.Popen:
    return subprocess.Popen(
        command(out, resume),
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_and_kill(out: Path, resume: bool, changes: int, delay: float) -> str:
    """Start the run and SIGKILL it ``delay`` seconds after the directory's ``changes``-th
    change (a file written, grown or renamed), unless it ends first; what it had written by
    then, for the report."""
    process = start(out, resume)
    killed = watch(process, out, changes, delay)
    if not killed:
        assert process.wait() == 0, process.stderr.read()
    process.stderr.close()
    return written(out) if killed else "finished first"


def written(out: Path) -> str:
    """A short description of how far a killed run got."""
    if not out.exists():
        return "no directory"
    names = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    ledger = out / "ledger.jsonl"
    lines = ledger.read_text().count("\n") if ledger.exists() else 0
    temps = sorted(n for n in names if Path(n).name.startswith("."))
    return (
        f"{'config ' if 'config.json' in names else ''}{lines} ledger lines"
        f"{' checkpoint' if 'checkpoint/state.safetensors' in names else ''}"
        f"{' final' if 'final/model.safetensors' in names else ''}"
        f"{' summary' if 'summary.json' in names else ''}"
        f"{' temp:' + ','.join(temps) if temps else ''}"
    )


def outputs(run: Path) -> dict:
    ledger = [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in (run / "ledger.jsonl").read_text().splitlines()
    ]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "weights": (run / "final" / "model.safetensors").read_bytes(),
        "checkpoint": checkpoint_bytes(run / "checkpoint" / "state.safetensors"),
        "ledger": ledger,
        "rollouts": (run / "rollouts.jsonl").read_text(),
        "evals": {
            p.relative_to(run).as_posix(): p.read_text()
            for p in sorted((run / "evals").rglob("*.jsonl"))
        },
        "summary_evals": {k: v for k, v in summary.items() if k.startswith("eval")},
    }


def checkpoint_bytes(path: Path) -> dict:
    """The checkpoint's entries as bytes, less the process's global torch RNG state: torch seeds
    that at random in every process, and the run draws nothing from it (two uninterrupted runs
    differ there and nowhere else)."""
    state = load_state(path)
    state.pop("torch_rng")
    return flat_bytes(state)


def flat_bytes(value, prefix=""):
    if isinstance(value, dict):
        return {
            k: v
            for key, item in value.items()
            for k, v in flat_bytes(item, f"{prefix}/{key}").items()
        }
    if isinstance(value, (list, tuple)):
        return {
            k: v
            for i, item in enumerate(value)
            for k, v in flat_bytes(item, f"{prefix}[{i}]").items()
        }
    if isinstance(value, torch.Tensor):
        return {
            prefix: (
                str(value.dtype),
                tuple(value.shape),
                value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(),
            )
        }
    return {prefix: value}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's outputs and how many changes of its directory the poll saw."""
    out = tmp_path_factory.mktemp("kill") / "reference"
    process = start(out, resume=False)
    seen, changes = None, 0
    while process.poll() is None:
        now = snapshot(out)
        if now != seen:
            seen, changes = now, changes + 1
        time.sleep(0.002)
    assert process.returncode == 0, process.stderr.read()
    process.stderr.close()
    return outputs(out), changes


@pytest.mark.parametrize("trial", range(KILL_TRIALS))
def test_a_run_killed_at_any_moment_resumes_bit_identical(reference, tmp_path, trial):
    """Regression: 7 of 25 kill trials could never be resumed (killed before the first
    checkpoint, during its write, during the before-training eval)."""
    expected, changes = reference
    draw = random.Random(trial)
    out = tmp_path / "run"
    # Killed at a random change of its directory (plus up to 0.2 s), then again while resuming.
    at = draw.randint(1, changes), draw.randint(1, max(1, changes // 2))
    first = run_and_kill(out, resume=False, changes=at[0], delay=draw.uniform(0.0, 0.2))
    # A run killed before it made its directory wrote nothing: it starts again without --resume.
    second = run_and_kill(out, resume=out.exists(), changes=at[1], delay=draw.uniform(0.0, 0.2))
    run_to_the_end(out, resume=out.exists())
    print(
        f"trial {trial}: killed after change {at[0]} of {changes} -> {first}; resume killed "
        f"after change {at[1]} -> {second}"
    )
    left = [p for p in out.rglob(".*") if p.name != LOCK_NAME]
    assert not left, "a temp file or half swap was left behind"
    assert outputs(out) == expected
    print(f"trial {trial}: resumed to the same bytes")
