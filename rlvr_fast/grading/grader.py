"""The grading entry points: one item, one response, or a batch; verdicts with reasons.

A call first runs the cheap stages of our pipeline in the caller (normalisation, structure,
numbers, text).  What they cannot settle goes to a worker process (``pool``), which runs
sympy and then, in the default mode, math-verify, all within the call's ``timeout``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlvr_fast.grading.equivalence import compare_answers
from rlvr_fast.grading.extraction import BOX_COMMANDS, MAX_ANSWER_CHARS, extract_boxed, passes_gate
from rlvr_fast.grading.pool import POOL
from rlvr_fast.grading.worker import OUT_OF_TIME

MODES = ("ours", "ours+math_verify", "math_verify")
DEFAULT_MODE = "ours+math_verify"
DEFAULT_TIMEOUT_S = 2.0
# An hour per item is far past any grading; beyond it a deadline overflows the clock's waits.
MAX_TIMEOUT_S = 3600.0
DEFAULT_BATCH_WORKERS = os.cpu_count() or 1


@dataclass(frozen=True)
class Verdict:
    """Whether an answer is correct, and why (``"different numbers"``, ``"out of time ..."``)."""

    correct: bool
    reason: str

    def __bool__(self) -> bool:
        return self.correct


def judge(
    pred: str | None, gold: str, *, mode: str = DEFAULT_MODE, timeout: float = DEFAULT_TIMEOUT_S
) -> Verdict:
    """The verdict on an extracted answer ``pred`` (None: no answer) against ``gold``.

    ``mode``: ``"ours"`` (our pipeline alone), ``"ours+math_verify"`` (math-verify is asked
    when our pipeline says False, unless that False is definite) or ``"math_verify"`` (its
    verdict alone).  ``timeout``: seconds the call may spend on worker work, waiting for a
    free worker included (not the pool's first start); 0 settles only what the cheap stages
    can.  Answers over ``MAX_ANSWER_CHARS`` are False without being parsed.
    """
    _check_timeout(timeout)
    verdict = _judge_in_caller(pred, gold, mode)
    return _judge_in_worker(pred, gold, mode, timeout) if verdict is None else verdict


def grade(
    pred: str | None, gold: str, *, mode: str = DEFAULT_MODE, timeout: float = DEFAULT_TIMEOUT_S
) -> bool:
    """True when the extracted answer ``pred`` is equivalent to ``gold`` (see ``judge``)."""
    return judge(pred, gold, mode=mode, timeout=timeout).correct


def judge_response(
    response_text: str,
    gold: str,
    *,
    min_chars: int | None = None,
    mode: str = DEFAULT_MODE,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Verdict:
    """The verdict on a full response: the gate (if ``min_chars``), its last box, ``judge``."""
    _check_timeout(timeout)
    _check_mode(mode)
    if min_chars is not None and not passes_gate(response_text, min_chars):
        return Verdict(False, f"the last \\boxed starts before char {min_chars} (gate)")
    answer = extract_boxed(response_text, max_chars=MAX_ANSWER_CHARS)
    if answer is None:
        return Verdict(False, _missing_answer_reason(response_text))
    return judge(answer, gold, mode=mode, timeout=timeout)


def grade_response(
    response_text: str,
    gold: str,
    *,
    min_chars: int | None = None,
    mode: str = DEFAULT_MODE,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Grade the last boxed answer of a full response; optionally apply the gate first."""
    return judge_response(
        response_text, gold, min_chars=min_chars, mode=mode, timeout=timeout
    ).correct


def judge_many(
    preds: Iterable[str | None],
    golds: Iterable[str],
    *,
    workers: int | None = None,
    mode: str = DEFAULT_MODE,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Verdict]:
    """``judge`` over pairs; items that need a worker run on ``workers`` workers at once
    (default: one per CPU core), each with its own ``timeout``."""
    preds, golds = list(preds), list(golds)
    if len(preds) != len(golds):
        raise ValueError(f"grade_many: {len(preds)} predictions but {len(golds)} gold answers")
    if workers is not None and workers < 1:
        raise ValueError(f"grade_many: workers must be >= 1, got {workers}")
    _check_timeout(timeout)
    verdicts = [_judge_in_caller(pred, gold, mode) for pred, gold in zip(preds, golds)]
    pending = [index for index, verdict in enumerate(verdicts) if verdict is None]
    if not pending:
        return verdicts
    threads = min(len(pending), workers or DEFAULT_BATCH_WORKERS)
    if timeout > 0:
        POOL.reserve(threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="rlvr-grade") as executor:
        judged = executor.map(
            lambda index: _judge_in_worker(preds[index], golds[index], mode, timeout), pending
        )
        for index, verdict in zip(pending, judged):
            verdicts[index] = verdict
    return verdicts


def grade_many(
    preds: Iterable[str | None],
    golds: Iterable[str],
    *,
    workers: int | None = None,
    mode: str = DEFAULT_MODE,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[bool]:
    """``grade`` over pairs of extracted answers and golds, in order (see ``judge_many``)."""
    verdicts = judge_many(preds, golds, workers=workers, mode=mode, timeout=timeout)
    return [verdict.correct for verdict in verdicts]


def _judge_in_caller(pred: str | None, gold: str, mode: str) -> Verdict | None:
    """The verdict when the cheap stages settle it; None when a worker must decide."""
    _check_mode(mode)
    if pred is None:
        return Verdict(False, "no answer")
    for side, text in (("answer", pred), ("gold answer", gold)):
        if len(text) > MAX_ANSWER_CHARS:
            cap = f"over the {MAX_ANSWER_CHARS:,} cap"
            return Verdict(False, f"{side} has {len(text):,} chars, {cap}")
    if mode == "math_verify":
        return None
    outcome = compare_answers(pred, gold, sympy_equal=None)
    if outcome.equal or outcome.definite or (mode == "ours" and not outcome.needs_sympy):
        return Verdict(outcome.equal, outcome.reason)
    return None


def _judge_in_worker(pred: str, gold: str, mode: str, timeout: float) -> Verdict:
    reply = POOL.judge((mode, pred, gold), timeout) if timeout > 0 else None
    if reply is None or reply[1] == OUT_OF_TIME:
        return Verdict(False, f"{OUT_OF_TIME} ({timeout:g} s budget)")
    return Verdict(*reply)


def _missing_answer_reason(response_text: str) -> str:
    if all(command not in response_text for command in BOX_COMMANDS):
        return "no \\boxed answer"
    return f"the last box does not close within {MAX_ANSWER_CHARS:,} chars"


def _check_timeout(timeout: float) -> None:
    """``timeout``: a number of seconds in [0, MAX_TIMEOUT_S] (NaN used to grade False
    silently, 1e300 to overflow the pool's wait)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"grading timeout must be a number of seconds, got {timeout!r}")
    if not 0 <= timeout <= MAX_TIMEOUT_S:
        raise ValueError(
            f"grading timeout must be in [0, {MAX_TIMEOUT_S:g}] seconds, got {timeout!r}"
        )


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown grading mode {mode!r}; valid: {', '.join(MODES)}")
    if mode != "ours" and not _math_verify_installed():
        raise RuntimeError(
            f"grading mode {mode!r} needs the math-verify package (pip install math-verify)"
        )


@functools.cache
def _math_verify_installed() -> bool:
    return importlib.util.find_spec("math_verify") is not None
