"""The golden test's second path, taken here: under ``ATEN_CPU_CAPABILITY=default`` torch runs
its kernels without vector extensions, a machine whose arithmetic has no recorded hashes. There
the golden test of one arm of each kind (flat, gated, tree, multi-question, parallel) must say
it compared determinism and figures under tolerance, and pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN_TEST = Path(__file__).with_name("test_golden.py")
ARMS = ("baseline", "ra_flat", "stopped_tree", "accum4", "shapley_vote")


@pytest.mark.slow
def test_golden_outputs_hold_on_a_machine_without_recorded_hashes(tmp_path):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS="1")
    selected = " or ".join(f"[{arm}]" for arm in ARMS)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            str(GOLDEN_TEST),
            "-k",
            selected,
            "--basetemp",
            str(tmp_path / "base"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"{len(ARMS)} passed" in output, output[-4000:]
    (line,) = [line for line in output.splitlines() if line.startswith("golden outputs:")]
    assert "has no hashes" in line and "figures within tolerance" in line, (
        "ATEN_CPU_CAPABILITY=default did not change the arithmetic's fingerprint: " + line
    )
