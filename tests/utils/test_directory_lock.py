"""The directory lock with real processes: a live holder refuses a second writer by pid, a
killed holder's lock is taken over, two writers racing for a fresh directory never both win, and
a forked child neither holds nor keeps its parent's lock."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

from rlvr_fast.utils.locks import LOCK_NAME, DirectoryLockedError, lock_directory

HOLD = """
import sys
from rlvr_fast.utils.locks import lock_directory
lock_directory(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def holder(directory) -> subprocess.Popen:
    """A process that holds ``directory``'s lock until its stdin closes."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "locked\n"
    return process


def test_a_second_writer_is_refused_naming_the_holders_pid(tmp_path):
    process = holder(tmp_path)
    try:
        with pytest.raises(DirectoryLockedError, match=f"in use by process {process.pid} "):
            lock_directory(tmp_path)
    finally:
        process.communicate("")
    with lock_directory(tmp_path) as lock:
        assert lock.held
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"


def test_a_killed_holders_lock_is_taken_over(tmp_path):
    process = holder(tmp_path)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (tmp_path / LOCK_NAME).read_text() == f"{process.pid}\n", "the stale lock file"
    with lock_directory(tmp_path) as lock:
        assert lock.held
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"


RACE = """
import os, sys, time
from rlvr_fast.utils.locks import DirectoryLockedError, lock_directory
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
try:
    lock_directory(sys.argv[1])
    print("won", flush=True)
except DirectoryLockedError:
    print("refused", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("trial", range(3))
def test_racing_writers_on_a_fresh_directory_never_both_win(tmp_path, trial):
    """Three processes released at once on one directory: one wins, the others are refused
    (each holds on until all have tried)."""
    (tmp_path / "run").mkdir()
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(tmp_path / "run"), str(go)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    go.touch()
    outcomes = sorted(racer.stdout.readline().strip() for racer in racers)
    for racer in racers:
        racer.communicate("")
    assert outcomes == ["refused", "refused", "won"]


def child_tries_the_lock(directory, results) -> None:
    try:
        lock_directory(directory)
        results.put("won")
    except DirectoryLockedError:
        results.put("refused")


def test_a_forked_child_does_not_inherit_the_lock(tmp_path):
    """The child sees the parent's lock as another process's, and once the parent lets go
    no copy of the descriptor in a child keeps the directory locked."""
    lock = lock_directory(tmp_path)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=child_tries_the_lock, args=(tmp_path, results))
    child.start()
    child.join(timeout=60)
    assert results.get(timeout=10) == "refused"
    lock.release()
    child = context.Process(target=child_tries_the_lock, args=(tmp_path, results))
    child.start()
    child.join(timeout=60)
    assert results.get(timeout=10) == "won"


def test_the_same_process_takes_its_own_lock_again(tmp_path):
    """A resume in the process that ran the run (the lock is held for the process's life)."""
    first = lock_directory(tmp_path)
    assert lock_directory(tmp_path) is first
    first.release()


def test_a_directory_made_again_is_locked_anew(tmp_path):
    (tmp_path / "run").mkdir()
    first = lock_directory(tmp_path / "run")
    (tmp_path / "run" / LOCK_NAME).unlink()
    (tmp_path / "run").rmdir()
    (tmp_path / "run").mkdir()
    second = lock_directory(tmp_path / "run")
    assert second is not first and second.held
    second.release()


def test_a_lock_file_that_is_not_a_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / LOCK_NAME)
    with pytest.raises(DirectoryLockedError, match="not a regular file"):
        lock_directory(tmp_path)
