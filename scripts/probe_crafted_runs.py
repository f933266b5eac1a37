"""Probe: a finished run directory damaged 20 ways (config.json, ledger, rollouts, summary,
evals, checkpoint, final model, signature), each run through verify, compare, report, eval and
train --resume. Prints one row per probe: the exit status (0 ok, 1 verify found a wrong line,
2 a one-line error) or TRACEBACK, and the last stderr line; exits 1 if any probe ended in a
traceback.

    OMP_NUM_THREADS=1 python scripts/probe_crafted_runs.py    # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from rlvr_fast.cli.main import main

TRAIN = [
    "train",
    "--arm",
    "zg_flat",
    "--quiet",
    "--set",
    "max_new_tokens=16",
    "--set",
    "eval_max_new_tokens=16",
    "--eval",
    "t=synthetic:test:2",
]


def edit_json(name: str, **fields):
    def damage(run: Path) -> None:
        (run / name).write_text(json.dumps({**json.loads((run / name).read_text()), **fields}))

    return damage


def write(name: str, data: str | bytes):
    def damage(run: Path) -> None:
        path = run / name
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)

    return damage


def cut(name: str, keep: int):
    return lambda run: (run / name).write_bytes((run / name).read_bytes()[:keep])


def null_gen(run: Path) -> None:
    lines = (run / "ledger.jsonl").read_text().splitlines()
    (run / "ledger.jsonl").write_text(
        "".join(json.dumps({**json.loads(line), "gen": None}) + "\n" for line in lines)
    )


DAMAGES = {
    "config []": write("config.json", "[]"),
    "config null config": edit_json("config.json", config=None),
    "config non-UTF-8": write("config.json", b"\xff\xfe"),
    "config nested 10^5 deep": write("config.json", "[" * 100_000 + "]" * 100_000),
    "ledger garbage line": write("ledger.jsonl", "garbage\n"),
    "ledger [] line": write("ledger.jsonl", "[]\n"),
    "ledger partial last line": lambda run: cut(
        "ledger.jsonl", (run / "ledger.jsonl").stat().st_size - 30
    )(run),
    "ledger missing": lambda run: (run / "ledger.jsonl").unlink(),
    "ledger null field": null_gen,
    "rollouts garbage": write("rollouts.jsonl", "{\n"),
    "rollouts missing": lambda run: (run / "rollouts.jsonl").unlink(),
    "summary []": write("summary.json", "[]"),
    "summary garbage": write("summary.json", "{"),
    "evals garbage": write("evals/t.jsonl", "x\n"),
    "evals [] line": write("evals/t.jsonl", "[]\n"),
    "checkpoint truncated": cut("checkpoint/state.safetensors", 500),
    "checkpoint a pickle": write("checkpoint/state.safetensors", b"\x80\x04K\x01."),
    "final model truncated": write("final/model.safetensors", b"12345678"),
    "final config []": write("final/config.json", "[]"),
    "signature arm null": edit_json("config.json", rlvr_fast_run={"format": 1, "arm": None}),
}
COMMANDS = {
    "verify": lambda run: ["verify", str(run)],
    "compare": lambda run: ["compare", str(run)],
    "report": lambda run: ["report", str(run), "--out", str(run.parent / "report")],
    "eval": lambda run: ["eval", str(run), "--eval", "t=synthetic:test:1", "--max-new-tokens", "8"],
    "resume": lambda run: [*TRAIN, "--steps", "3", "--out", str(run), "--resume"],
}


def run_cli(argv: list[str]) -> tuple[int | str, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except BaseException as error:  # what the probe looks for
            code = "TRACEBACK " + traceback.format_exception_only(type(error), error)[-1].strip()
    return code, err.getvalue().strip().splitlines()


def main_probe() -> int:
    root = Path(tempfile.mkdtemp(prefix="probe-crafted-"))
    base = root / "base"
    code, _ = run_cli([*TRAIN, "--steps", "2", "--out", str(base)])
    assert code == 0, "the base run did not train"
    tracebacks = 0
    for name, damage in DAMAGES.items():
        for command, argv in COMMANDS.items():
            work = root / "work"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work / "run")
            damage(work / "run")
            code, lines = run_cli(argv(work / "run"))
            tracebacks += str(code).startswith("TRACEBACK")
            print(
                f"{name:26s} {command:8s} {str(code):4s} {lines[-1][:120] if lines else ''}",
                flush=True,
            )
    shutil.rmtree(root)
    print(f"{len(DAMAGES) * len(COMMANDS)} probes, {tracebacks} tracebacks")
    return 1 if tracebacks else 0


if __name__ == "__main__":
    sys.exit(main_probe())
