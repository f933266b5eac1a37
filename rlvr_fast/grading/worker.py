"""The grading worker process: judges one item per request, within the request's deadline.

A request is ``(mode, pred, gold, seconds)``; the reply is ``(equal, reason)``.  The worker runs
our pipeline with sympy, then math-verify when the mode asks for it and our False is not
definite, all under one ``SIGALRM`` timer of ``seconds``: when it fires, pure-Python work
(sympy, math-verify) stops, the reply is ``(False, OUT_OF_TIME)`` and the worker exits (what
it was interrupted in may have left broken state behind; the pool forks a fresh one).  Work
stuck in C cannot be interrupted that way; the caller kills the worker after a short grace
period instead.
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection

from rlvr_fast.grading.equivalence import compare_answers
from rlvr_fast.grading.latex_sympy import sympy_sources_equal
from rlvr_fast.grading.second_opinion import math_verify_equal, quiet_math_verify

READY = "ready"
OUT_OF_TIME = "out of time"


class OutOfTime(BaseException):
    """The request's deadline passed.  A BaseException, so sympy's and math-verify's
    ``except Exception`` blocks cannot swallow it."""


def serve(conn: Connection) -> None:
    """Worker main loop: answer requests until the parent hangs up."""
    signal.signal(signal.SIGALRM, _raise_out_of_time)
    warm_up()
    conn.send(READY)
    while True:
        try:
            mode, pred, gold, seconds = conn.recv()
        except (EOFError, OSError):
            return
        reply = judge_within(mode, pred, gold, seconds)
        conn.send(reply)
        if reply[1] == OUT_OF_TIME:
            return  # an interrupted sympy or parser may have left broken state: never reuse it


def judge_within(mode: str, pred: str, gold: str, seconds: float) -> tuple[bool, str]:
    """``judge_fully`` stopped after ``seconds`` (needs the SIGALRM handler of ``serve``)."""
    if seconds <= 0:
        return False, OUT_OF_TIME
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            return judge_fully(mode, pred, gold)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except OutOfTime:
        return False, OUT_OF_TIME


def judge_fully(mode: str, pred: str, gold: str) -> tuple[bool, str]:
    """(equal, reason): our pipeline with sympy, then math-verify if ``mode`` asks for it."""
    if mode != "math_verify":
        outcome = compare_answers(pred, gold, sympy_sources_equal)
        if outcome.equal or outcome.definite or mode == "ours":
            return outcome.equal, outcome.reason
    if math_verify_equal(pred, gold):
        return True, "equal by math-verify"
    if mode == "math_verify":
        return False, "not equivalent"
    return False, "not equivalent (nor by math-verify)"


def _raise_out_of_time(signum: int, frame: object) -> None:
    raise OutOfTime


def warm_up() -> None:
    """Build sympy's and math-verify's caches and grammars (the first calls are slow)."""
    quiet_math_verify()
    judge_fully("ours", "\\frac{x}{2}", "0.5x")
    judge_fully("math_verify", "\\sqrt{8}", "2\\sqrt{2}")
