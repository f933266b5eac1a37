"""rlvr-fast command line: a short run end to end, and one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

from rlvr_fast.cli.main import main

SHORT = ["--set", "max_new_tokens=48", "--set", "eval_max_new_tokens=48", "--quiet"]


def test_train_then_eval_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--arm",
                "ra_flat",
                "--steps",
                "2",
                "--eval",
                "test=synthetic:test:8",
                "--out",
                str(out),
                *SHORT,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "test: accuracy" in printed and "TFLOPs" in printed
    lines = printed.splitlines()
    # The figures first, then where the run is and how long it took, then the accounting.
    assert lines[lines.index("arm ra_flat, 2 steps") + 1].startswith("  reward ")
    assert "(mean of the first and last 1 steps)" in printed
    assert f"  run directory {out}, wall time " in printed
    assert "seconds per phase: rollout " in printed and ", grading " in printed
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["arm"] == "ra_flat" and config["config"]["gate_min_chars"] == 30
    assert "torch" in config["versions"]
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 2
    assert (out / "evals" / "before" / "test.jsonl").is_file()
    assert len((out / "evals" / "test.jsonl").read_text().splitlines()) == 8
    assert (
        main(
            [
                "eval",
                str(out),
                "--eval",
                "test=synthetic:test:8",
                "--max-new-tokens",
                "48",
                "--out",
                str(tmp_path / "ev"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "ev" / "summary.json").read_text())["test"]["items"] == 8


def test_log_every_prints_a_line_of_figures_every_n_steps(tmp_path, capsys):
    argv = ["train", "--arm", "baseline", "--steps", "4", "--log-every", "2"]
    assert main([*argv, "--out", str(tmp_path / "run"), *SHORT]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 2/4", "step 4/4"]
    # baseline steps backward on every step: each line has its loss and gradient norm.
    assert all("reward " in line and "loss " in line and "grad_norm " in line for line in steps)
    assert main([*argv[:-1], "-1", "--out", str(tmp_path / "bad"), *SHORT]) == 2
    assert "--log-every must be >= 0" in capsys.readouterr().err


def write_bad_jsonl(path):
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--arm", "tree"], "unknown arm 'tree'"),
        (["--arm", "baseline", "--train-data", "missing.jsonl"], "no such file"),
        (["--arm", "baseline", "--train-data", "BAD"], "bad.jsonl:2: missing field 'answer'"),
        (["--arm", "baseline", "--set", "learnrate=1"], "unknown setting 'learnrate'"),
        (["--arm", "baseline", "--set", "top_p=2"], "top_p must be in (0, 1]"),
        (["--arm", "baseline", "--set", "lr"], "--set wants key=value"),
        (["--arm", "baseline", "--set", "arm=ra_flat"], "arm is chosen with --arm"),
        (["--arm", "baseline", "--set", "group_size=abc"], "group_size"),
        (["--arm", "baseline", "--eval", "nonsense"], "--eval wants NAME=PATH"),
        (["--arm", "baseline", "--model", "no/such/dir"], "not a model directory"),
    ],
)
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
    assert "not an rlvr_fast run directory" in capsys.readouterr().err
    (out / "ledger.jsonl").unlink()
    short = ["--set", "max_new_tokens=8", "--quiet"]
    assert main(["train", "--arm", "baseline", "--steps", "1", "--out", str(out), *short]) == 0
    assert main(["train", "--arm", "baseline", "--steps", "1", "--out", str(out), *short]) == 2
    assert "already holds a run (use --resume" in capsys.readouterr().err


def test_multi_question_arm_and_active_steps_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    # On the first 12 synthetic questions at 96 tokens, the second step is the first active one.
    assert (
        main(
            [
                "train",
                "--arm",
                "accum4",
                "--steps",
                "3",
                "--active-steps",
                "1",
                "--set",
                "t_min=8",
                "--set",
                "t_max=16",
                "--out",
                str(out),
                *SHORT,
                "--set",
                "max_new_tokens=96",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert all(len(line["questions"]) == 4 for line in lines)
    assert [line["active"] for line in lines] == [False, True]
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["active_steps"] == 1 and config["zero_cont_mass"]
    assert f"{len(lines)} steps" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0
    assert (
        main(
            [
                "train",
                "--arm",
                "ra_flat",
                "--steps",
                "3",
                "--active-steps",
                "4",
                "--out",
                str(tmp_path / "bad"),
                *SHORT,
            ]
        )
        == 2
    )
    assert "active_steps must be in [1, steps = 3]" in capsys.readouterr().err


def model_copy(tmp_path, damage=None):
    """A copy of the embedded model, with ``damage(directory)`` done to it."""
    import shutil

    from rlvr_fast.models.policy import TINY_MODEL_DIR

    directory = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, directory)
    if damage is not None:
        damage(directory)
    return str(directory)


def truncate(name, size=100):
    return lambda directory: (directory / name).write_bytes((directory / name).read_bytes()[:size])


def config_with(**fields):
    def damage(directory):
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **fields}))

    return damage


# Inputs that once ended in a traceback (or a hang), each with the words its one
# line must hold.
TRACEBACK_INPUTS = {
    "--set steps=5": (["--set", "steps=5"], "--set steps: steps is chosen with --steps"),
    "--set seed=1": (["--set", "seed=1"], "--set seed: seed is chosen with --seed"),
    "config.json that is []": (
        ["--model", lambda t: model_copy(t, lambda d: (d / "config.json").write_text("[]"))],
        "expected a JSON object",
    ),
    "config.json with a null field": (
        ["--model", lambda t: model_copy(t, config_with(hidden_size=None))],
        "hidden_size",
    ),
    "non-UTF-8 config.json": (
        ["--model", lambda t: model_copy(t, lambda d: (d / "config.json").write_bytes(b"\xff{"))],
        "config.json",
    ),
    "truncated model.safetensors": (
        ["--model", lambda t: model_copy(t, truncate("model.safetensors"))],
        "model.safetensors",
    ),
    "truncated tokenizer.json": (
        ["--model", lambda t: model_copy(t, truncate("tokenizer.json"))],
        "tokenizer.json",
    ),
    "--device cuda without CUDA": (["--device", "cuda:99"], "CUDA device(s) available"),
    "--device bogus": (["--device", "bogus"], "--device 'bogus': expected auto, cpu or cuda[:N]"),
    "lr=Infinity": (["--set", "lr=Infinity"], "lr must be a finite number"),
    "lr=NaN": (["--set", "lr=NaN"], "lr must be a finite number"),
    "empty train data": (["--train-data", lambda t: str(empty_file(t))], "empty.jsonl"),
    "eval name escaping --out": (["--eval", "../../x=synthetic:test:2"], "eval set name"),
    "eval set of 10^8 problems": (
        ["--eval", "t=synthetic:test:100000000"],
        "the size limit of a problem set",
    ),
    "question over the length limit": (
        ["--train-data", lambda t: str(long_question(t))],
        "over the 100,000 limit",
    ),
    "questions_per_step of 10^9": (
        ["--set", "questions_per_step=1000000000"],
        "questions_per_step must be in [1, 1024]",
    ),
    "max_batch of -1": (["--set", "max_batch=-1"], "max_batch must be in [1, 65536]"),
}


def empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    return tmp_path / "empty.jsonl"


def long_question(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"problem": "1 + " * 50_000 + "1", "answer": "50001"}) + "\n")
    return path


@pytest.mark.parametrize("case", TRACEBACK_INPUTS)
def test_the_inputs_that_ended_in_a_traceback_are_one_line_errors(tmp_path, capsys, case):
    args, message = TRACEBACK_INPUTS[case]
    args = [a(tmp_path) if callable(a) else a for a in args]
    out = tmp_path / "run"
    assert (
        main(["train", "--arm", "zg_flat", "--steps", "1", *args, "--out", str(out), *SHORT]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err, err
    assert message in err, err
    assert not out.exists(), "nothing is written for bad input"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-batch", "-1"], "--max-batch must be in [1, 65,536], got -1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be in [1, 1,048,576], got 0"),
        (["--eval", "../x=synthetic:test:2"], "eval set name '../x'"),
        (["--device", "cuda:99"], "CUDA device(s) available"),
    ],
)
def test_eval_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "ev"
    argv = ["eval", "tiny", *args, "--out", str(out)]
    if "--eval" not in args:
        argv += ["--eval", "t=synthetic:test:2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err and message in err, err
    assert not out.exists() and not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-batch", "0"], "--max-batch must be in [1, 65,536]"),
        (["--k", "100000"], "--k must be in [1, 4096]"),
        (["--temperature", "inf"], "--temperature must be a finite number > 0"),
        (["--device", "bogus"], "expected auto, cpu or cuda[:N]"),
        (["--out", "OUT.txt"], "--out must end in .json or .jsonl"),
    ],
)
def test_select_data_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    args = [str(tmp_path / "sel.txt") if a == "OUT.txt" else a for a in args]
    argv = ["select-data", "--data", "synthetic:train:2", "--quiet", *args]
    if "--out" not in args:
        argv += ["--out", str(tmp_path / "sel.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err and message in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["verify", "compare", "report"])
def test_crafted_run_directories_are_one_line_errors(tmp_path, capsys, command):
    """A config.json nested past Python's recursion limit ended verify, compare and report in
    a RecursionError traceback. verify fails the run (exit 1), the others exit 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    argv = [command, str(run)] + (["--out", str(tmp_path / "rep")] if command == "report" else [])
    assert main(argv) == (1 if command == "verify" else 2)
    captured = capsys.readouterr()
    if command == "verify":
        assert f"FAIL: {run}" in captured.out
        assert "config.json: JSON nested too deeply" in captured.out
    else:
        err = captured.err.strip()
        assert err.startswith("rlvr-fast: error:") and "\n" not in err, err
        assert "config.json: JSON nested too deeply" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
