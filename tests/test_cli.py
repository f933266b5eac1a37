"""rlvr-fast command line: a short run end to end, and one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

from rlvr_fast.cli import main

SHORT = ["--set", "max_new_tokens=48", "--set", "eval_max_new_tokens=48", "--quiet"]


def test_train_then_eval_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--arm", "ra_flat", "--steps", "2", "--eval", "test=synthetic:test:8",
                 "--out", str(out), *SHORT]) == 0
    printed = capsys.readouterr().out
    assert "test: accuracy" in printed and "TFLOPs" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["arm"] == "ra_flat" and config["config"]["gate_min_chars"] == 30
    assert "torch" in config["versions"]
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 2
    assert (out / "evals" / "before" / "test.jsonl").is_file()
    assert len((out / "evals" / "test.jsonl").read_text().splitlines()) == 8
    assert main(["eval", str(out), "--eval", "test=synthetic:test:8", "--max-new-tokens", "48",
                 "--out", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "summary.json").read_text())["test"]["items"] == 8


def write_bad_jsonl(path):
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    return path


@pytest.mark.parametrize("args,message", [
    (["--arm", "tree"], "unknown arm 'tree'"),
    (["--arm", "baseline", "--train-data", "missing.jsonl"], "no such file"),
    (["--arm", "baseline", "--train-data", "BAD"], "bad.jsonl:2: missing field 'answer'"),
    (["--arm", "baseline", "--set", "learnrate=1"], "unknown setting 'learnrate'"),
    (["--arm", "baseline", "--set", "top_p=2"], "top_p must be in (0, 1]"),
    (["--arm", "baseline", "--set", "lr"], "--set wants key=value"),
    (["--arm", "baseline", "--set", "arm=ra_flat"], "chosen by name"),
    (["--arm", "baseline", "--set", "group_size=abc"], "group_size"),
    (["--arm", "baseline", "--eval", "nonsense"], "--eval wants NAME=PATH"),
    (["--arm", "baseline", "--model", "no/such/dir"], "not a model directory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    args = [str(write_bad_jsonl(tmp_path / "bad.jsonl")) if a == "BAD" else a for a in args]
    out = tmp_path / "run"
    assert main(["train", *args, "--out", str(out), *SHORT]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err
    assert message in err
    assert not out.exists(), "nothing is written for bad input"


def test_existing_run_needs_resume(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ledger.jsonl").write_text("")
    assert main(["train", "--arm", "baseline", "--steps", "1", "--out", str(out), *SHORT]) == 2
    assert "--resume" in capsys.readouterr().err


def test_multi_question_arm_and_active_steps_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    # On the first 12 synthetic questions at 96 tokens, the second step is the first active one.
    assert main(["train", "--arm", "accum4", "--steps", "3", "--active-steps", "1",
                 "--set", "t_min=8", "--set", "t_max=16", "--out", str(out), *SHORT,
                 "--set", "max_new_tokens=96"]) == 0
    lines = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert all(len(line["questions"]) == 4 for line in lines)
    assert [line["active"] for line in lines] == [False, True]
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["active_steps"] == 1 and config["zero_cont_mass"]
    assert f"{len(lines)} steps" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0
    assert main(["train", "--arm", "ra_flat", "--steps", "3", "--active-steps", "4",
                 "--out", str(tmp_path / "bad"), *SHORT]) == 2
    assert "active_steps must be in [1, steps = 3]" in capsys.readouterr().err
