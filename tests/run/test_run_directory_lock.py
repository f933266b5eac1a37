"""One writer per run directory, and a start that cleans only what is ours (issue 28, items 1
and 2): a second writer is refused by the holder's pid with nothing written, a killed run's lock
is taken over by its resume, and a directory of someone else's temp-looking files is refused,
not emptied."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_runs import environment, script_process, train_command

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.utils.locks import LOCK_NAME
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import RunDirectoryError
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer

SETTINGS = dict(max_new_tokens=16, eval_max_new_tokens=16, lr=1e-4, checkpoint_every=1)
PROBLEMS = synthetic_problems("train", 2, seed=3)
HOLD = """
import sys
from rlvr_fast.utils.locks import lock_directory
lock_directory(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def trainer(out, *, steps=2, resume=False):
    config = TrainConfig.from_arm("zg_flat", steps=steps, **SETTINGS)
    return RLVRTrainer(
        load_policy("tiny"), config, PROBLEMS, {}, out_dir=out, resume=resume, progress=False
    )


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    trainer(run).train()
    return run


def test_out_with_only_foreign_temp_looking_names_is_refused_and_kept(tmp_path):
    """Regression: `train --out` deleted .backup.tmp/deep/thesis.tex, .notes.tmp and .tmpAB12CD
    (names that looked like our temp files) and started a run, exit 0."""
    out = tmp_path / "out"
    (out / ".backup.tmp" / "deep").mkdir(parents=True)
    (out / ".backup.tmp" / "deep" / "thesis.tex").write_text("chapter 1")
    (out / ".notes.tmp").write_text("notes")
    (out / ".tmpAB12CD").write_text("mine")
    (out / ".config.json.abcd1234.tmp").write_text("an old version's temp file")
    before = tree_digest(out)
    with pytest.raises(RunDirectoryError, match="not empty and not an rlvr_fast run directory"):
        trainer(out)
    assert tree_digest(out) == before
    assert not (out / LOCK_NAME).exists(), "nothing written into a directory that is refused"


def test_a_start_killed_before_config_json_is_cleaned_on_the_next_start(tmp_path):
    """The lock file is the signature of a start of ours: its temp files go, the run starts."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text("12345\n")
    (out / ".config.json.abcd1234.tmp").write_text("{")
    trainer(out, steps=1).train()
    assert not (out / ".config.json.abcd1234.tmp").exists()
    assert (out / "summary.json").is_file()


def test_a_resume_while_another_process_holds_the_run_is_refused_naming_it(finished, tmp_path):
    """Regression: a `train --resume` started while the first `train` still ran interleaved
    both ledgers (54 lines for 40 steps), both exit 0."""
    out = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(out)], check=True)
    before = tree_digest(out)
    holder = script_process(HOLD, out)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunDirectoryError, match=f"in use by process {holder.pid} "):
            trainer(out, steps=3, resume=True)
    finally:
        holder.communicate("")
    after = tree_digest(out)
    assert {k: v for k, v in after.items() if k != LOCK_NAME} == {
        k: v for k, v in before.items() if k != LOCK_NAME
    }
    trainer(out, steps=3, resume=True).train()  # the holder is gone: the resume runs
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 3


def test_a_second_train_on_a_running_out_exits_2_naming_the_pid(tmp_path):
    """Real `rlvr-fast train` processes: a `--resume` on the --out of a running one exits 2
    with one line naming its pid, a fresh `train` there with one line too; the running one's ledger holds one
    line per step, in order (tests/test_kill_resume.py resumes killed runs: their locks are
    taken over)."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        train_command(out), env=environment(), stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "ledger.jsonl").is_file() or not (out / "ledger.jsonl").stat().st_size:
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first run wrote no ledger line"
            time.sleep(0.2)
        # Stopped, it still holds its lock, without taking a core from the processes below.
        first.send_signal(signal.SIGSTOP)
        for extra, message in (
            (["--resume"], f"in use by process {first.pid} "),
            ([], "already holds a run"),
        ):
            second = subprocess.run(
                train_command(out, *extra),
                env=environment(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert second.returncode == 2, second.stderr
            assert second.stderr.count("\n") == 1, second.stderr
            assert message in second.stderr
            assert first.poll() is None, "the first run still runs"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    whole = (out / "ledger.jsonl").read_text().split("\n")[:-1]  # a SIGKILL may cut the last
    steps = [json.loads(line)["step"] for line in whole]
    assert steps == list(range(len(steps)))
