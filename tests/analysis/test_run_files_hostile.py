"""The analysis commands on hostile run directories (issue 28, items 5, 8, 10, 12): every
failure one line, exit 1 for verify and 2 for the others, nothing hangs, nothing of anyone else
is overwritten, and runs of one arm that are not seeds of one experiment are refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import within

from rlvr_fast.analysis.sweep import SweepError, plan_sweep, run_sweep
from rlvr_fast.cli.main import main
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer

SHORT = dict(steps=2, max_new_tokens=16, eval_max_new_tokens=16, lr=1e-4)
EVAL_SETS = {"t": synthetic_problems("test", 4)}
TRAIN = synthetic_problems("train", 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished seeds of one arm."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (1, 2):
        config = TrainConfig.from_arm("zg_flat", seed=seed, **SHORT)
        RLVRTrainer(
            load_policy("tiny"), config, TRAIN, EVAL_SETS, out_dir=root / f"s{seed}", progress=False
        ).train()
    return root


def copy_of(runs: Path, tmp_path: Path) -> Path:
    shutil.copytree(runs, tmp_path / "runs")
    return tmp_path / "runs"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlvr-fast: error: "), err
    return err


def verify_fails_with(capsys, run: Path, message: str) -> None:
    with within(60):
        assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL: {run}" in out and message in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", "summary.json: not a JSON object (a list)"),
        ('{"eval_after": [1]}', "summary.json: eval_after is not an object of eval sets"),
        ("[" * 100_000 + "]" * 100_000, "summary.json: JSON nested too deeply"),
    ],
    ids=["a list", "a list of eval sets", "nested 100,000 deep"],
)
def test_a_summary_json_that_is_not_a_summary(runs, tmp_path, capsys, content, message):
    """Regression: summary.json holding a list was an AttributeError in verify and report."""
    run = copy_of(runs, tmp_path) / "s1"
    (run / "summary.json").write_text(content)
    verify_fails_with(capsys, run, message)
    assert main(["report", str(run.parent), "--out", str(tmp_path / "report")]) == 2
    assert f"{run}: fails verify" in capsys.readouterr().err, "refused unless allowed"
    report = ["report", str(run.parent), "--out", str(tmp_path / "report")]
    assert main([*report, "--allow-unverified"]) == 0
    assert "`rlvr-fast verify`: 1 of 2 runs PASS" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("name", ["ledger.jsonl", "rollouts.jsonl", "config.json"])
@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero"])
def test_a_run_file_that_is_a_fifo_or_dev_zero_fails_verify_at_once(
    runs, tmp_path, capsys, name, kind
):
    """Regression: a FIFO as ledger.jsonl hung verify and compare forever; a link to /dev/zero
    read until MemoryError."""
    run = copy_of(runs, tmp_path) / "s1"
    (run / name).unlink()
    if kind == "FIFO":
        os.mkfifo(run / name)
    else:
        os.symlink("/dev/zero", run / name)
    expected = "a FIFO" if kind == "FIFO" else "a character device"
    verify_fails_with(capsys, run, f"{name}: not a regular file ({expected})")
    if name != "rollouts.jsonl":  # compare reads the ledger's totals, not the rollouts
        with within(60):
            assert main(["compare", str(run.parent)]) == 2
        assert f"{name}: not a regular file" in one_error_line(capsys)


def test_a_deeply_nested_ledger_line_fails_verify(runs, tmp_path, capsys):
    run = copy_of(runs, tmp_path) / "s1"
    with open(run / "ledger.jsonl", "a") as file:
        file.write("[" * 100_000 + "]" * 100_000 + "\n")
    verify_fails_with(capsys, run, "ledger.jsonl:3: JSON nested too deeply")


def edit_signature(run: Path, key: str, value) -> None:
    meta = json.loads((run / "config.json").read_text())
    meta["rlvr_fast_run"][key] = value
    (run / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("model_sha256", "0" * 64, "differ in the starting model (weights or tokenizer) ("),
        ("train_data", {"problems": 2, "sha256": "f" * 64}, "differ in the training problems"),
        ("eval_data", {"t": "e" * 64}, "differ in the evaluation sets"),
        ("dtype", "bfloat16", "differ in dtype"),
    ],
)
def test_compare_refuses_seeds_of_one_arm_that_differ_beyond_the_seed(
    runs, tmp_path, capsys, key, value, named
):
    """Regression: compare pooled runs of two models into one row (`baseline | 8.33% ± 7.22%`)."""
    copy = copy_of(runs, tmp_path)
    edit_signature(copy / "s2", key, value)
    assert main(["compare", str(copy)]) == 2
    err = one_error_line(capsys)
    assert f"runs of arm zg_flat {named}" in err and "only the seed may differ" in err


def test_report_out_refuses_a_directory_it_did_not_write(runs, tmp_path, capsys):
    """Regression: `report --out` wrote into any directory (an accuracy.png of the user's was
    replaced)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "accuracy.png").write_bytes(b"my figure")
    assert main(["report", str(runs), "--out", str(mine)]) == 2
    assert "not empty and not a report directory" in one_error_line(capsys)
    assert (mine / "accuracy.png").read_bytes() == b"my figure"
    report = tmp_path / "report"
    assert main(["report", str(runs), "--out", str(report)]) == 0
    assert main(["report", str(runs), "--out", str(report)]) == 0, "its own directory again"


@pytest.mark.parametrize(
    "held,message",
    [
        (["thesis.tex"], "no .rlvr_fast.lock"),
        (["compare.md"], "no .rlvr_fast.lock"),  # regression: a sweep replaced it
        ([".rlvr_fast.lock", "thesis.tex"], "holds 'thesis.tex', which a sweep does not write"),
    ],
)
def test_sweep_out_refuses_a_foreign_directory(tmp_path, held, message):
    for name in held:
        (tmp_path / name).write_text("mine")
    plan = plan_sweep(["zg_flat"], [1], tmp_path, **SHORT)
    with pytest.raises(SweepError, match=message):
        run_sweep(plan, tmp_path, TRAIN, EVAL_SETS, lambda: load_policy("tiny"), progress=False)
    assert sorted(os.listdir(tmp_path)) == sorted(held)
    assert all((tmp_path / name).read_text() == "mine" for name in held)


def test_a_rerun_sweep_with_other_training_data_is_refused_before_training(tmp_path):
    """Regression: a rerun sweep with another --train-data or --eval skipped its finished runs
    and reprinted the old tables."""
    plan = plan_sweep(["zg_flat"], [1], tmp_path, **SHORT)
    run_sweep(plan, tmp_path, TRAIN, EVAL_SETS, lambda: load_policy("tiny"), progress=False)
    other = synthetic_problems("train", 2, seed=9)
    with pytest.raises(SweepError, match="the training problems differ from the run's"):
        run_sweep(plan, tmp_path, other, EVAL_SETS, lambda: load_policy("tiny"), progress=False)
    other_evals = {"t": synthetic_problems("test", 4, seed=9)}
    with pytest.raises(SweepError, match="the evaluation sets differ from the run's"):
        run_sweep(plan, tmp_path, TRAIN, other_evals, lambda: load_policy("tiny"), progress=False)


HOLD = """
import sys
from rlvr_fast.utils.locks import lock_directory
lock_directory(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_sweep_on_one_out_is_refused_naming_the_first(tmp_path):
    """Regression: two sweeps on one --out 3.5 s apart left 3 of 4 runs failing verify."""
    root = str(Path(__file__).resolve().parents[2])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        plan = plan_sweep(["zg_flat"], [1], tmp_path, **SHORT)
        with pytest.raises(SweepError, match=f"in use by process {holder.pid} "):
            run_sweep(plan, tmp_path, TRAIN, EVAL_SETS, lambda: load_policy("tiny"), progress=False)
    finally:
        holder.communicate("")
    assert not (tmp_path / "runs").exists()
