"""Bad input refused with one line before anything is written (issue 39, item 5): a KV cache
that cannot hold one sequence, a data row with a key given twice, a directory as data, eval of a
run that has not finished, a ledger line of the wrong shape in verify, and a second Ctrl-C while
an interrupted command exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr_fast.cli.main import main


def train(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--arm",
        "zg_flat",
        "--steps",
        "1",
        "--quiet",
        "--set",
        "max_new_tokens=8",
        "--out",
        str(out),
        *extra,
    ]


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_a_kv_cache_too_small_for_one_sequence_is_refused_before_the_run_directory(
    tmp_path, capsys
):
    """Regression: `--set kv_blocks=1` exited 2 after writing config.json and an empty ledger
    (and the rerun then said "already holds a run")."""
    out = tmp_path / "run"
    err = refused(train(out, "--train-data", "synthetic:train:2", "--set", "kv_blocks=1"), capsys)
    assert "out of KV blocks: the longest sequence (prompt and max_new_tokens)" in err
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_data_row_with_a_key_given_twice_is_refused(tmp_path, capsys, suffix):
    """Regression: a row {"answer": "2", "answer": "3"} trained on 3."""
    row = '{"question": "What is 1 + 1?", "answer": "2", "answer": "3"}'
    data = tmp_path / f"train{suffix}"
    data.write_text(row + "\n" if suffix == ".jsonl" else f"[{row}]\n")
    out = tmp_path / "run"
    err = refused(train(out, "--train-data", str(data)), capsys)
    assert f"{data}:1: unreadable JSON (duplicate key 'answer' in one object)" in err
    assert not out.exists()


def test_a_directory_as_data_is_named_as_one(tmp_path, capsys):
    """Regression: a directory as data said "no such file"."""
    data = tmp_path / "problems"
    data.mkdir()
    err = refused(train(tmp_path / "run", "--train-data", str(data)), capsys)
    assert "not a regular file (a directory)" in err


def test_eval_of_a_run_that_has_not_finished_says_so(tmp_path, capsys):
    """Regression: `eval` of a running run said "no tokenizer.json"."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"rlvr_fast_run": {}, "config": {}}))
    err = refused(["eval", str(run), "--eval", "t=synthetic:test:2"], capsys)
    assert "a run that has not finished" in err


def test_verify_fails_a_ledger_line_of_the_wrong_shape_without_a_traceback(tmp_path, capsys):
    """Regression: a ledger line with `parallel: 0` raised AttributeError in verify."""
    run = tmp_path / "run"
    argv = train(run, "--train-data", "synthetic:train:2")
    argv[argv.index("zg_flat")] = "loo_vote"
    assert main(argv) == 0
    capsys.readouterr()
    lines = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    lines[0]["parallel"] = 0
    (run / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    # A parallel arm's line: its registered record needs the object (null is another kind's).
    assert "step 0: parallel is 0, not an object" in out


SECOND_INTERRUPT = """
import atexit, os, signal, sys, time
import rlvr_fast.cli.main as cli

def interrupted(args):
    raise KeyboardInterrupt

def second_interrupt():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)

atexit.register(second_interrupt)
cli.run_compare = interrupted
sys.exit(cli.main(["compare", sys.argv[1]]))
"""


def test_a_second_ctrl_c_while_an_interrupted_command_exits_prints_nothing_more(tmp_path):
    """Regression: a second SIGINT during the final save printed an atexit traceback after
    "interrupted"."""
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", SECOND_INTERRUPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "rlvr-fast: interrupted\n"
