"""Issue 28's output cases of the command line: eval --out never replaces what it did not write
and writes nothing when a set fails; --nproc checks the arguments once, before any rank starts;
a stdout closed early ends the command quietly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlvr_fast.cli import main as cli_main
from rlvr_fast.cli.main import main
from rlvr_fast.train import distributed

EVAL = ["--max-new-tokens", "4", "--max-batch", "8"]


def eval_into(out, *sets):
    argv = ["eval", "tiny", *EVAL, "--out", str(out)]
    for spec in sets or ["t=synthetic:test:2"]:
        argv += ["--eval", spec]
    return main(argv)


def contents(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err, err
    return err


def test_eval_out_writes_its_files_and_takes_its_own_directory_again(tmp_path, capsys):
    out = tmp_path / "ev"
    assert eval_into(out) == 0
    assert json.loads((out / "summary.json").read_text())["t"]["items"] == 2
    assert eval_into(out, "t=synthetic:test:3", "u=synthetic:test:1") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["t"]["items"] == 3 and summary["u"]["items"] == 1
    assert len((out / "t.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize(
    "held,message",
    [
        ({"config.json": b"{}", "ledger.jsonl": b"{}\n", "summary.json": b"{}"}, "config.json"),
        ({"notes.txt": b"mine"}, "not an eval's output"),
        ({".rlvr_fast.lock": b"", "thesis.tex": b"mine"}, "'thesis.tex'"),
    ],
    ids=["a run directory", "a foreign directory", "a foreign file beside an eval's lock"],
)
def test_eval_out_refuses_a_directory_it_did_not_write(tmp_path, capsys, held, message):
    out = tmp_path / "ev"
    out.mkdir()
    for name, data in held.items():
        (out / name).write_bytes(data)
    assert eval_into(out, "ledger=synthetic:test:1") == 2
    assert message in one_error_line(capsys)
    assert contents(out) == held


def test_eval_with_a_good_and_a_bad_set_writes_nothing(tmp_path, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"problem": "1 + " * 20_000 + "1", "answer": "20001"}) + "\n")
    out = tmp_path / "ev"
    assert eval_into(out, "good=synthetic:test:1", f"bad={long}") == 2
    assert "exceeds the model's" in one_error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--arm", "bogus", "--out", "R"], "bogus"),
        (["train", "--arm", "zg_flat", "--set", "group_size=0", "--out", "R"], "group_size"),
        (["eval", "tiny", "--eval", "t=nowhere.jsonl"], "nowhere.jsonl"),
    ],
)
def test_nproc_checks_the_arguments_once_before_any_rank_starts(
    tmp_path, capsys, monkeypatch, argv, message
):
    started = []
    monkeypatch.setattr(distributed, "launch", lambda *a: started.append(a) or 0)
    argv = [str(tmp_path / a) if a == "R" else a for a in argv]
    assert main([*argv, "--nproc", "3"]) == 2
    assert message in one_error_line(capsys)
    assert started == [] and list(tmp_path.iterdir()) == []


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("[1]")  # verify prints its FAIL lines to stdout
    process = subprocess.Popen(
        [sys.executable, "-m", "rlvr_fast.cli", "verify", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert err == "", err


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 5200573225 bytes. Error code 12 (Cannot allocate memory)"
        ),
    ],
    ids=["MemoryError", "torch's CPU allocator"],
)
def test_an_allocation_that_fails_is_one_line_naming_the_settings(capsys, monkeypatch, error):
    def run_out_of_memory(args):
        raise error

    monkeypatch.setattr(cli_main, "run_select_data", run_out_of_memory)
    assert main(["select-data", "--data", "synthetic:train:2", "--out", "x.json"]) == 2
    err = one_error_line(capsys)
    assert "lower group_size, max_batch" in err and "Error code" not in err, err


def test_any_other_runtime_error_is_not_swallowed(monkeypatch):
    def run_broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_main, "run_select_data", run_broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["select-data", "--data", "synthetic:train:2", "--out", "x.json"])
