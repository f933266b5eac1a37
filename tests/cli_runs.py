"""A `rlvr-fast train` started as its own process, as the lock tests start the runs they race."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def environment(**extra: str) -> dict[str, str]:
    """This environment, one OpenMP thread, and the checkout importable from the child."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": ROOT if not path else f"{ROOT}{os.pathsep}{path}",
        **extra,
    }


def train_command(out: Path, *extra: str) -> list[str]:
    """A zero-gradient flat run long enough to be raced (100,000 steps), checkpointing every step."""
    return [
        sys.executable,
        "-m",
        "rlvr_fast.cli",
        "train",
        "--arm",
        "zg_flat",
        "--steps",
        "100000",
        "--quiet",
        "--train-data",
        "synthetic:train:4",
        "--set",
        "max_new_tokens=8",
        "--set",
        "checkpoint_every=1",
        "--out",
        str(out),
        *extra,
    ]


def script_process(script: str, path: Path) -> subprocess.Popen:
    """``python -c script path`` with pipes to talk to it: a lock holder the test steers by stdin."""
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=environment(),
    )
