"""A lock that survives its file (issue 39, item 1): a holder whose lock file was removed or
replaced stops at its next write (exit 3, one line, nothing more written), a newcomer is refused
while that holder lives, lock files are removed at a clean exit, and an output file's lock is
never placed beside the user's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import environment, script_process, train_command

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import RunDirectoryError
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.utils.locks import (
    LOCK_NAME,
    DirectoryLockedError,
    LockLostError,
    lock_directory,
    lock_output,
)

HOLD_THEN_CHECK = """
import sys
from rlvr_fast.utils.locks import LockLostError, lock_directory
lock = lock_directory(sys.argv[1])
print("locked", flush=True)
sys.stdin.readline()
try:
    lock.check()
    print("held", flush=True)
except LockLostError as err:
    print("lost:", err, flush=True)
"""


def trainer(out, *, steps=2, resume=False):
    config = TrainConfig.from_arm(
        "zg_flat", steps=steps, max_new_tokens=8, eval_max_new_tokens=8, checkpoint_every=1
    )
    problems = synthetic_problems("train", 2, seed=3)
    return RLVRTrainer(
        load_policy("tiny"), config, problems, {}, out_dir=out, resume=resume, progress=False
    )


@pytest.mark.parametrize("swap", ["removed", "replaced"])
def test_a_newcomer_is_refused_while_the_holder_of_a_swapped_lock_file_lives(tmp_path, swap):
    """Regression: with the lock file deleted or replaced under a live run, a `--resume` took a
    fresh lock and trained alongside it (101 rollouts lines for 60 steps, both exit 0)."""
    holder = script_process(HOLD_THEN_CHECK, tmp_path)
    try:
        assert holder.stdout.readline() == "locked\n"
        (tmp_path / LOCK_NAME).unlink()
        if swap == "replaced":
            (tmp_path / LOCK_NAME).write_text("99999\n")
        with pytest.raises(DirectoryLockedError, match="lock file .* was removed or replaced"):
            lock_directory(tmp_path)
        holder.stdin.write("\n")
        holder.stdin.flush()
        answer = holder.stdout.readline()
    finally:
        holder.communicate("")
    assert answer.startswith("lost: "), answer
    assert "was removed or replaced" in answer
    with lock_directory(tmp_path) as lock:  # the holder is gone: the directory is free
        assert lock.held


@pytest.mark.parametrize("swap", ["removed", "replaced"])
def test_a_trainer_whose_lock_file_is_swapped_writes_nothing_more(tmp_path, swap):
    out = tmp_path / "run"
    run = trainer(out)
    lock = out / LOCK_NAME
    lock.unlink()
    if swap == "replaced":
        lock.write_text("12345\n")
    with pytest.raises(LockLostError, match="removed or replaced"):
        run.train()
    assert (out / "ledger.jsonl").read_text() == ""
    assert not (out / "rollouts.jsonl").exists()
    assert not (out / "checkpoint").exists()
    assert not (out / "summary.json").exists()
    run.recorder.lock.release()


def with_steps(command: list[str], steps: int) -> list[str]:
    at = command.index("--steps") + 1
    return command[:at] + [str(steps)] + command[at + 1 :]


def lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def test_a_running_train_whose_lock_file_is_deleted_exits_3_and_a_resume_is_refused(tmp_path):
    """Real processes: the lock file of a running `train` is deleted; a `--resume` started then
    exits 2 with one line; the running one exits 3 with one line at its next write, its ledger a
    prefix of its steps, no line after the deletion but the one write already checked."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        train_command(out), env=environment(), stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while len(lines(out / "ledger.jsonl")) < 1:
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first run wrote no ledger line"
            time.sleep(0.2)
        first.send_signal(signal.SIGSTOP)
        seen = len(lines(out / "ledger.jsonl"))
        (out / LOCK_NAME).unlink()
        second = subprocess.run(
            train_command(out, "--resume"),
            env=environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert "was removed or replaced" in second.stderr
        first.send_signal(signal.SIGCONT)
        _, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 3, stderr
    assert stderr.count("\n") == 1 and "was removed or replaced" in stderr, stderr
    ledger = lines(out / "ledger.jsonl")
    assert seen <= len(ledger) <= seen + 1, "at most the write checked before the deletion"
    assert [json.loads(line)["step"] for line in ledger] == list(range(len(ledger)))
    assert len(lines(out / "rollouts.jsonl")) <= len(ledger)
    assert not (out / LOCK_NAME).exists(), "neither process left a lock file"


def test_a_finished_run_leaves_no_lock_file_and_resumes(tmp_path):
    """Regression: lock files stayed behind after runs."""
    out = tmp_path / "run"
    done = subprocess.run(
        with_steps(train_command(out), 2), env=environment(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not (out / LOCK_NAME).exists()
    assert not [p for p in out.rglob(".*")], "no hidden file left"


def test_an_output_files_lock_is_in_the_cache_directory_and_removed_at_exit(tmp_path):
    """Regression: select-data's `.OUT.lock` stayed beside the user's own data file."""
    cache = tmp_path / "cache"
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    script = (
        "import sys, os\n"
        "from rlvr_fast.utils.locks import lock_output\n"
        "lock = lock_output(sys.argv[1])\n"
        "print(lock.path, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(data / "selected.json")],
        env=environment(XDG_CACHE_HOME=str(cache)),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.parent == cache / "rlvr_fast" / "locks"
    assert sorted(os.listdir(data)) == ["train.jsonl"], "nothing beside the user's data"
    assert not path.exists(), "removed at exit"


def test_a_run_directory_refused_after_its_lock_leaves_no_lock_file(tmp_path):
    """A refusal after the lock was taken (an existing run without --resume) removes the lock
    file at exit, as a clean exit does."""
    out = tmp_path / "run"
    done = subprocess.run(
        with_steps(train_command(out), 1), env=environment(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    again = subprocess.run(
        with_steps(train_command(out), 1), env=environment(), capture_output=True, text=True
    )
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert not (out / LOCK_NAME).exists()
    with pytest.raises(RunDirectoryError, match="already holds a run"):
        trainer(out, steps=1)


def test_a_newcomer_that_opened_a_removed_lock_file_locks_the_new_one(tmp_path):
    """Race-free removal: a holder that removes its lock file as it lets go leaves a newcomer
    that had opened the old file to lock a new one, never the removed one."""
    first = lock_directory(tmp_path)
    stale = os.open(tmp_path / LOCK_NAME, os.O_RDWR)  # a newcomer's open, before the removal
    first.release(remove=True)
    second = lock_directory(tmp_path)
    assert second.held and (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert os.fstat(stale).st_ino != os.stat(tmp_path / LOCK_NAME).st_ino
    os.close(stale)
    second.release()


def test_a_holder_pid_is_named_when_the_newcomer_looks_just_after_the_lock(tmp_path):
    """Regression: one race in three named the holder "process unknown" (the holder had locked
    its file but not yet written its pid)."""
    script = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(0.3)\n"
        "os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
        "sys.stdin.read()\n"
    )
    holder = script_process(script, tmp_path / LOCK_NAME)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DirectoryLockedError, match=f"in use by process {holder.pid} "):
            lock_directory(tmp_path)
    finally:
        holder.communicate("")


def test_lock_output_refuses_a_second_holder_in_this_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    held = lock_output(tmp_path / "out.json")
    assert held.path.parent == tmp_path / "cache" / "rlvr_fast" / "locks"
    assert lock_output(tmp_path / "out.json") is held
    held.release(remove=True)
    assert not held.path.exists()
