"""The GPU suite's helpers (benchmarks/gpu): a run's figures read back from its ledger, never a
figure scaled up from fewer steps, and the dependency check. ``check.sh --dry-run`` (make test)
runs the whole suite on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

GPU_SUITE = Path(__file__).parents[2] / "benchmarks" / "gpu"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU_SUITE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_report = load("run_report")
environment = load("environment")


def fake_run(tmp_path: Path, steps: int, ledger_steps: int) -> Path:
    """A run directory of ``steps`` configured steps whose ledger holds ``ledger_steps`` lines
    of 2 + 1 seconds each, every rollout at the 512 cap."""
    (tmp_path / "config.json").write_text(
        json.dumps({"config": {"arm": "baseline", "steps": steps, "max_new_tokens": 512}})
    )
    line = {
        "seconds": {"rollout": 2.0, "backward": 1.0},
        "active": True,
        "pairs": [[0, 0, 512, 512, 0.0, 0.0, "flat"]] * 4,
        "gen": 4096,
        "prefill_run": 150,
        "decode_rows": 4088,
        "bwd_out": 4096,
    }
    (tmp_path / "ledger.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for _ in range(ledger_steps))
    )
    return tmp_path


def test_a_run_cut_short_reports_its_steps_and_no_full_run_figure(tmp_path):
    section, headline = run_report.report(fake_run(tmp_path, 50, 23), 124, 151.0, 140)
    assert headline == "baseline: 23 of 50 steps, 3.00 s per step"
    assert "23 of 50 steps, stopped at its 140 s limit" in section
    assert "**no 50-step figure**: 23 steps ran, 69.0 s of step time" in section
    assert "50-step time" not in section and "150.0" not in section, "50 x 3 s extrapolated"


def test_a_finished_run_reports_its_step_time_beside_the_study(tmp_path):
    section, headline = run_report.report(fake_run(tmp_path, 50, 50), 0, 170.0, 140)
    assert headline == "baseline: 50 steps, 150.0 s step time"
    assert "| rollout | 100.00 | 2.000 |" in section
    assert "rollouts: 400 of 400 at the 512-token cap" in section
    assert "**50-step time: 150.0 s of step time** (the study: 438-530 s" in section


def test_every_step_ran_before_a_kill_during_the_final_checkpoint(tmp_path):
    section, headline = run_report.report(fake_run(tmp_path, 50, 50), 124, 141.0, 140)
    assert "while writing the final checkpoint" in section
    assert headline == "baseline: 50 steps, 150.0 s step time"


def test_a_run_that_never_started_says_so(tmp_path):
    section, headline = run_report.report(tmp_path / "missing", 1, 3.0, 140)
    assert headline == "no run directory (failed (exit 1)); see the log"


def test_missing_runtime_dependencies_are_named(monkeypatch):
    assert environment.missing_dependencies() == []
    monkeypatch.setattr(
        environment,
        "requires",
        lambda name: [
            "torch>=2.11",
            "no-such-package-here>=1",
            "pytest>=8; extra == 'dev'",
            "torch<1; python_version < '3'",
        ],
    )
    assert environment.missing_dependencies() == ["no-such-package-here>=1 (installed: none)"]


@pytest.mark.parametrize("name", ["check.sh", "environment.py", "run_report.py"])
def test_the_suite_calls_python_as_python3(name):
    """The GPU machine's interpreter is python3 (there may be no python); pip runs as a module."""
    for line in (GPU_SUITE / name).read_text().splitlines():
        words = line.replace("(", " ").split()
        for before, word in zip(["", *words], words):
            assert word != "python" and (word != "pip" or before == "-m"), line
