"""Grading worker processes behind per-call deadlines, safe to use from any number of threads.

* Workers are forked from a forkserver that imported this package and warmed sympy and
  math-verify once (``forkserver_preload``): a new worker is ready in about 0.05 s, never
  inherits a caller's threads or CUDA state, and a script that grades needs the usual
  ``if __name__ == "__main__":`` guard.
* Each worker serves one call at a time.  One spare worker is kept ready (started in the
  background) while the pool is below ``max_workers``, so a growing number of threads and
  a worker killed after a timeout are replaced in the background, not on the next caller.
* ``judge(request, timeout)``: the call may take ``timeout`` seconds from when it asks,
  waiting for a free worker included; the worker stops its own work at the deadline (and is
  replaced), and one that has not answered ``GRACE_S`` later is killed.  So no call outlives
  its budget by more than ``GRACE_S`` plus a kill.
* Not charged to any deadline: the pool's first start (the forkserver and first worker,
  seconds) and ``reserve(n)``, which starts n workers before a batch.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from rlvr_fast.grading.worker import OUT_OF_TIME, READY, serve

GRACE_S = 0.25
# A worker forks in well under a second, but the forkserver's first start imports torch
# (through rlvr_fast/__init__), sympy and math-verify, which takes seconds on a loaded machine.
START_TIMEOUT_S = 120.0
SPARES = 1
DEFAULT_MAX_WORKERS = max(4, os.cpu_count() or 1) + SPARES

# A module name, not an import: importing it warms sympy and math-verify, in the forkserver only.
_FORKSERVER_PRELOAD = "rlvr_fast.grading.forkserver_preload"
Reply = tuple[bool, str]
_START_FAILED = (
    "the grading worker process failed to start; a script that calls grade() needs an "
    "`if __name__ == '__main__':` guard (worker start-up re-imports the main script)"
)


class WorkerPool:
    """Worker processes judging one ``(mode, pred, gold)`` request each (see module doc)."""

    def __init__(self, max_workers: int = DEFAULT_MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._generation = 0
        self._reset_state()

    def judge(self, request: tuple[str, str, str], timeout: float) -> Reply | None:
        """The worker's ``(equal, reason)``; None, or ``OUT_OF_TIME`` as the reason, when the
        call ran out of its ``timeout``."""
        self._wait_for_first_worker()
        deadline = time.monotonic() + timeout
        worker = self._acquire(deadline)
        if worker is None:
            return None
        reply = worker.ask(request, deadline)
        if reply is None or reply[1] == OUT_OF_TIME:
            self._discard(worker)  # a worker that ran out of time exits after its reply
        else:
            self._release(worker)
        return reply

    def reserve(self, workers: int) -> None:
        """Keep at least ``workers`` workers (plus the spare); wait until that many are ready."""
        with self._cond:
            self._min_workers = max(self._min_workers, workers + SPARES)
            self.max_workers = max(self.max_workers, self._min_workers)
            self._refill()
            self._wait(lambda: len(self._idle) + self._busy >= workers, "reserve")

    def worker_count(self) -> int:
        """Workers alive or starting."""
        with self._cond:
            return len(self._idle) + self._busy + self._starting

    def idle_pids(self) -> list[int]:
        """Process ids of the workers waiting for a call."""
        with self._cond:
            return [worker.process.pid for worker in self._idle]

    def close(self) -> None:
        """Kill every worker; the next call starts afresh.  Busy workers die when they return."""
        with self._cond:
            idle = self._idle
            self._generation += 1
            self._reset_counts()
            self._cond.notify_all()
        for worker in idle:
            worker.kill()

    def forget_after_fork(self) -> None:
        # A forked child must neither use nor kill its parent's workers.
        self._generation += 1
        self._reset_state()

    def _reset_state(self) -> None:
        self._cond = threading.Condition()
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._idle: list[_Worker] = []
        self._busy = 0
        self._starting = 0
        self._min_workers = 0
        self._ready_once = False
        self._start_error: str | None = None

    def _wait_for_first_worker(self) -> None:
        with self._cond:
            if self._ready_once:
                return
            self._refill()
            self._wait(lambda: self._ready_once, "first start")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (lock held) until ``ready()``; RuntimeError once no start can make it so."""
        give_up = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if self._start_error is not None and not self._starting:
                raise RuntimeError(self._start_error)
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"grading workers not ready after {START_TIMEOUT_S:g} s ({what})"
                )
            self._cond.wait(remaining)

    def _acquire(self, deadline: float) -> _Worker | None:
        with self._cond:
            while not self._idle:
                if self._start_error is not None and not (self._busy or self._starting):
                    raise RuntimeError(self._start_error)
                self._refill()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            worker = self._idle.pop()
            self._busy += 1
            self._refill()
            return worker

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if worker.generation == self._generation:
                self._busy -= 1
                self._idle.append(worker)
                self._cond.notify()
                return
        worker.kill()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._cond:
            if worker.generation == self._generation:
                self._busy -= 1
                self._refill()
                self._cond.notify_all()

    def _refill(self) -> None:
        """Start workers in the background (lock held) up to the spare and the reserve."""
        total = len(self._idle) + self._busy + self._starting
        while total < self.max_workers and (
            len(self._idle) + self._starting < SPARES or total < self._min_workers
        ):
            self._starting += 1
            total += 1
            threading.Thread(
                target=self._start_one,
                args=(self._generation,),
                name="rlvr-grading-start",
                daemon=True,
            ).start()

    def _start_one(self, generation: int) -> None:
        try:
            worker, error = _Worker.start(generation), None
        except RuntimeError as start_error:
            worker, error = None, str(start_error)
        with self._cond:
            current = generation == self._generation
            if current:
                self._starting -= 1
                if worker is not None:
                    self._idle.append(worker)
                    self._ready_once = True
                    self._start_error = None
                else:
                    self._start_error = error
                self._cond.notify_all()
        if worker is not None and not current:
            worker.kill()


class _Worker:
    """One worker process and the caller's end of its pipe."""

    def __init__(self, process: BaseProcess, conn: Connection, generation: int) -> None:
        self.process = process
        self.conn = conn
        self.generation = generation

    @classmethod
    def start(cls, generation: int) -> _Worker:
        context = _context()
        parent_conn, child_conn = context.Pipe()
        process = context.Process(
            target=serve, args=(child_conn,), name="rlvr-grading-worker", daemon=True
        )
        process.start()
        child_conn.close()
        worker = cls(process, parent_conn, generation)
        try:
            ready = parent_conn.poll(START_TIMEOUT_S) and parent_conn.recv() == READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            worker.kill()
            raise RuntimeError(_START_FAILED)
        return worker

    def ask(self, request: tuple[str, str, str], deadline: float) -> Reply | None:
        """The reply to ``request``, or None if none came by ``deadline`` + ``GRACE_S``."""
        seconds = deadline - time.monotonic()
        if seconds <= 0:
            return None
        try:
            self.conn.send((*request, seconds))
            if self.conn.poll(seconds + GRACE_S):
                return self.conn.recv()
        except (EOFError, OSError):  # the worker died (e.g. out of memory)
            pass
        return None

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join()


@functools.cache
def _context() -> BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Global to the process, and only read when the forkserver first starts.
    context.set_forkserver_preload([_FORKSERVER_PRELOAD])
    return context


POOL = WorkerPool()
atexit.register(POOL.close)
os.register_at_fork(after_in_child=POOL.forget_after_fork)
