"""Tests for rlvr_fast.grading: extraction, the gate, answer equivalence in every mode, the
worker pool's time budget under threads, and agreement on the held-out case table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlvr_fast.grading import (
    MAX_ANSWER_CHARS,
    MAX_SYMPY_CHARS,
    extract_boxed,
    final_answer,
    grade,
    grade_many,
    grade_response,
    judge,
    judge_many,
    judge_response,
    passes_gate,
)
from rlvr_fast.grading.pool import GRACE_S, POOL

REPO_ROOT = Path(__file__).resolve().parents[2]
HELD_OUT_TABLE = REPO_ROOT / "tests" / "grading" / "grading_heldout.tsv"

# (prediction, gold, expected) in the default mode. The False rows are false positives a lax
# grader makes.
GRADE_CASES = [
    # plain and GSM8K-style numbers
    ("5", "5", True),
    ("5.0", "5", True),
    (".5", "0.5", True),
    ("5.", "5", True),
    ("-5", "5", False),
    ("10", "100", False),
    ("12", "1.2", False),
    ("1,000,000", "1000000", True),
    ("1,000", "1", False),
    ("\\$1,234.50", "1234.5", True),
    ("\\$ 1,000,000", "1000000", True),
    ("1{,}000", "1000", True),
    ("1\\,000", "1000", True),
    ("1.0000001", "1", True),
    ("1.00001", "1", False),
    ("12345678", "12345679", False),  # exact spellings compare exactly, whatever their size
    ("\\frac{1}{3}", "0.3333333", True),  # a decimal is a rounded value
    ("0.0000000001", "0", True),
    ("0.000001", "0", False),
    ("", "0", False),
    # fractions
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("\\tfrac{1}{4}", "0.25", True),
    ("\\frac12", "\\frac{1}{2}", True),
    ("\\frac1{2}", "1/2", True),
    ("\\frac{1}2", "0.5", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-1}{2}", "-0.5", True),
    ("-\\frac12", "0.5", False),
    ("1/2", "2", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("\\frac{1}{0}", "1", False),
    # roots, constants and symbolic equivalence (sympy stage)
    ("\\sqrt2", "\\sqrt{2}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}2", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\sqrt[3]{8}", "2", True),
    ("\\sqrt{2}", "2", False),
    ("\\sqrt{2}", "1.41421356", True),
    ("\\sqrt{2}", "1.41", False),
    ("3\\pi", "\\pi \\cdot 3", True),
    ("\\pi", "3.14159265", True),
    ("\\pi", "3.14", False),
    ("\\dfrac{\\pi}{2}", "\\frac\\pi2", True),
    ("e", "2.718281828", True),
    ("2^{10}", "1024", True),
    ("2^{30}", "1073741824", True),
    ("2^{30}", "1073741825", False),
    ("2 \\times 3", "6", True),
    ("5!", "120", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\frac{x}{2}", "0.5x", True),
    ("\\pi r^2", "r^2\\pi", True),
    ("x^2", "x^3", False),
    ("\\sqrt{x^2}", "x", False),
    ("2x+1", "2x-1", False),
    # leading variable, units, degrees, percent, dollars
    ("x=5", "5", True),
    ("x = 5", "5", True),
    ("k = 3", "3", True),
    ("y = 2x + 3", "2x+3", True),
    ("90^\\circ", "90", True),
    ("90^{\\circ}", "90", True),
    ("90°", "90", True),
    ("5 \\text{ cm}", "5", True),
    ("6 \\text{ cm}^2", "6", True),
    ("5\\mbox{ inches}", "5", True),
    ("10 dollars", "10", True),
    ("\\$5", "5", True),
    ("50\\%", "50", True),
    ("50\\%", "0.5", False),  # MATH convention: the percent sign is dropped
    ("50\\%", "5", False),
    ("3 + 2\\mathrm{i}", "3", False),
    ("$\\frac{1}{2}$", "1/2", True),
    # text and multiple choice
    ("\\text{Monday}", "Monday", True),
    ("\\text{monday}", "Monday", True),
    ("Monday", "Tuesday", False),
    ("Monday", "5", False),
    ("\\text{(A)}", "A", True),
    ("\\textbf{(C)}", "C", True),
    ("\\textbf{(C)}", "(D)", False),
    ("A", "B", False),
    # tuples and intervals
    ("(1,2)", "(1, 2)", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("(0.5, 3)", "(\\frac{1}{2}, 3)", True),
    ("(1,2)", "(2,1)", False),
    ("(1,2)", "[1,2]", False),
    ("[0,1]", "(0,1)", False),
    ("[0,1)", "[0, 1)", True),
    ("\\left[ 0, 1 \\right)", "[0,1)", True),
    ("(-\\infty, 3]", "(-\\inf,3]", True),
    ("(-\\infty, 3]", "(-\\infty, 3)", False),
    ("(1,2,3)", "(1,2)", False),
    ("(-\\infty,0)\\cup(1,\\infty)", "(1,\\infty)\\cup(-\\infty,0)", True),
    ("\\infty", "-\\infty", False),
    # sets and solution lists (unordered)
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("1, 2", "2, 1", True),
    ("-2, \\frac{1}{2}", "0.5, -2", True),
    # matrices
    (
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        "\\begin{bmatrix}1&2\\\\3&\\frac{8}{2}\\end{bmatrix}",
        True,
    ),
    (
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}",
        False,
    ),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\end{pmatrix}", False),
    # answer forms of MATH / MATH-500 / AMC solutions
    ("\\$32,\\!348", "32348", True),
    ("10,\\!000", "10000", True),
    ("11\\sqrt2", "11\\sqrt{2}", True),
    ("\\frac{3\\sqrt{3}}{2}", "\\frac{3}{2}\\sqrt{3}", True),
    ("p-q", "-q+p", True),
    ("12\\text{ inches}^2", "12", True),
    ("\\text{Evelyn}", "Evelyn", True),
    ("\\textbf{(B)}", "B", True),
    ("x \\in [-2,7]", "[-2,7]", True),
    ("f(x) = 2x+1", "2x+1", True),
    ("y = 2x+1", "y = 2x-1", False),
    ("2\\frac{1}{4}", "\\frac{9}{4}", True),  # a mixed number
    ("-1\\frac{1}{2}", "-1.5", True),
    ("2\\frac{1}{4}", "\\frac{1}{2}", False),
    ("3 and 4", "3, 5", False),
    ("2, 2, 5", "2, 5", True),
    ("a=3, b=-1", "a=-1, b=3", False),  # labels on both sides must agree
    ("a=3, b=-1", "b=-1, a=3", True),
    # answer forms the grader once missed, one row each, with a near miss beside it
    ("(2,12) \\cup (12,102)", "(2,12)\\cup(12,102)", True),
    ("(2,12)\\cup(12,102)", "(2,12)\\cup(12,103)", False),
    ("x = -5, p = \\frac{14}{3}", "-5, \\frac{14}{3}", True),
    ("x = -5, p = \\frac{14}{3}", "-5, \\frac{14}{5}", False),
    ("AB=4,CD=5", "4,5", True),
    ("(p,q)=(3,2)", "(3,2)", True),
    ("(p,q)=(3,2)", "(2,3)", False),
    ("S:T=7:32", "7:32", True),
    ("S:T=7:32", "7:31", False),
    ("6 \\text{ and } 8", "6, 8", True),
    ("6 \\text{ and } 8", "6, 9", False),
    ("(11,7) or (7,11)", "(7,11), (11,7)", True),
    ("1; 2", "1, 2", True),
    ("1; 2", "1, 3", False),
    ("11,\\! 111,\\! 100", "11111100", True),
    ("11,\\! 111,\\! 100", "11111101", False),
    ("(1,2), (1,2), (3,4)", "(1,2), (3,4)", True),
    ("(1,2), (1,2)", "(1,2), (3,4)", False),
    # undefined values equal nothing, themselves included
    ("\\frac{1}{0}", "\\frac{2}{0}", False),
    ("\\frac{1}{0}", "\\frac{1}{0}", False),
    ("1/0", "2/0", False),
    ("\\frac{1}{0}", "\\infty", False),
    ("\\frac{x}{0.0}", "\\frac{y}{0}", False),
    # digits of any script are the same digits (full-width, Arabic-Indic, Devanagari)
    ("５", "5", True),
    ("１２３", "123", True),
    ("٣", "3", True),
    ("५", "5", True),
    ("(１，２)", "(1,2)", True),
    ("٣", "4", False),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), GRADE_CASES)
def test_grade_table(pred: str, gold: str, expected: bool) -> None:
    assert grade(pred, gold) is expected


@pytest.mark.parametrize(("pred", "gold", "expected"), GRADE_CASES)
def test_grade_is_symmetric(pred: str, gold: str, expected: bool) -> None:
    assert grade(gold, pred) is expected


def test_grade_many_matches_one_at_a_time() -> None:
    preds = [pred for pred, _, _ in GRADE_CASES] + [None]
    golds = [gold for _, gold, _ in GRADE_CASES] + ["5"]
    expected = [verdict for _, _, verdict in GRADE_CASES] + [False]
    assert grade_many(preds, golds, workers=3) == expected
    assert grade_many(preds[-12:], golds[-12:], workers=1) == expected[-12:]


def test_grade_many_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="2 predictions but 1 gold"):
        grade_many(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="workers must be >= 1"):
        grade_many(["1"], ["1"], workers=0)
    assert grade_many([], []) == []


# (prediction, gold, verdict in "ours", "ours+math_verify", "math_verify")
MODE_CASES = [
    ("\\binom{5}{2}", "10", (False, True, True)),  # our converter has no \binom
    ("\\log_2 8", "3", (False, True, True)),
    # math-verify reads a tuple and a bare list of the same items as equal; we do not
    ("(1,2)", "1,2", (False, True, True)),
    # a definite False of ours (two plain numbers, MATH's percent convention) stands
    ("50\\%", "0.5", (False, False, True)),
    ("\\sqrt{8}", "2\\sqrt{2}", (True, True, True)),
    ("3", "5", (False, False, False)),
]


@pytest.mark.parametrize(("pred", "gold", "verdicts"), MODE_CASES)
def test_modes(pred: str, gold: str, verdicts: tuple[bool, bool, bool]) -> None:
    modes = ("ours", "ours+math_verify", "math_verify")
    assert tuple(grade(pred, gold, mode=mode) for mode in modes) == verdicts


def test_unknown_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown grading mode 'sympy'; valid: ours, "):
        grade("1", "1", mode="sympy")


def test_held_out_agreement_without_false_accepts() -> None:
    cases = [
        line.split("\t")
        for line in HELD_OUT_TABLE.read_text().splitlines()
        if not line.startswith("#")
    ]
    verdicts = grade_many([case[0] for case in cases], [case[1] for case in cases])
    expected = [case[2] == "1" for case in cases]
    agree = sum(v == e for v, e in zip(verdicts, expected))
    false_accepts = [case[:2] for case, v, e in zip(cases, verdicts, expected) if v and not e]
    assert len(cases) >= 150
    assert false_accepts == []
    assert agree / len(cases) >= 0.97, f"agreement {agree}/{len(cases)}"


# --- verdicts and their reasons ---------------------------------------------------


def test_verdict_reasons() -> None:
    assert judge(None, "5").reason == "no answer"
    assert judge("12", "1.2").reason == "different numbers"
    assert judge("\\frac{1}{0}", "\\frac{2}{0}").reason == "undefined value (zero denominator)"
    assert judge("\\sqrt{8}", "2\\sqrt{2}").reason == "equal by sympy"
    assert judge("\\binom{5}{2}", "10").reason == "equal by math-verify"
    assert not judge("", "0")
    assert judge("0.5", "\\frac12")


def test_grade_none_or_empty_is_false() -> None:
    assert grade(None, "5") is False
    assert grade("", "") is False
    assert grade("$ $", "") is False


def test_inputs_over_the_cap_are_false_without_parsing() -> None:
    long_answer = "1" * (MAX_ANSWER_CHARS + 1)
    verdict = judge(long_answer, long_answer)
    assert not verdict and verdict.reason == "answer has 1,001 chars, over the 1,000 cap"
    assert judge("1", long_answer).reason == "gold answer has 1,001 chars, over the 1,000 cap"


def test_a_huge_box_is_refused_quickly() -> None:
    response = "We get \\boxed{" + "1" * 10_000_000 + "}"
    start = time.monotonic()
    verdict = judge_response(response, "1")
    assert time.monotonic() - start < 0.5
    assert verdict.reason == "the last box does not close within 1,000 chars"
    assert extract_boxed(response, max_chars=MAX_ANSWER_CHARS) is None
    assert extract_boxed(response[:5000] + "}") == "1" * (5000 - len("We get \\boxed{"))


def test_long_scalars_skip_sympy() -> None:
    under_limit = "+".join(["x"] * 50)
    over_limit = "+".join(["x"] * 101)
    assert len(under_limit) <= MAX_SYMPY_CHARS < len(over_limit)
    assert grade(under_limit, "50x", mode="ours") is True
    assert grade(over_limit, "101x", mode="ours") is False


def test_cheap_stages_do_not_start_a_worker() -> None:
    POOL.close()
    for pred, gold in [
        ("1,000", "1000"),
        ("12", "1.2"),
        ("\\frac{1}{2}", "0.5"),
        ("A", "B"),
        ("Monday", "5"),
        ("(1, 2)", "(2,1)"),
        ("\\frac{1}{0}", "\\frac{2}{0}"),
    ]:
        grade(pred, gold)
    grade_response("so \\boxed{(1, 2)}", "(2,1)")
    grade_many(["7", "8", None], ["7", "7", "7"])
    assert POOL.worker_count() == 0


# --- the time budget: deadlines, restarts, threads ----------------------------------


def test_pathological_input_runs_out_of_time_and_the_worker_recovers() -> None:
    assert grade("\\sqrt{8}", "2\\sqrt{2}")  # start the pool outside the timed part
    for pathological in ["(x+1)^{100000}", "9^{9^{9^{9}}}", "(10^6)!"]:
        start = time.monotonic()
        verdict = judge(pathological, "(x+1)^{100001}", timeout=0.5)
        assert time.monotonic() - start < 0.5 + 0.5
        assert verdict.reason == "out of time (0.5 s budget)"
    assert grade("\\sqrt{8}", "2\\sqrt{2}")


def test_zero_timeout_settles_only_the_cheap_stages() -> None:
    assert judge("\\sqrt{8}", "2\\sqrt{2}", timeout=0.0).reason == "out of time (0 s budget)"
    assert grade("1,000", "1000", timeout=0.0) is True


def test_a_killed_worker_is_replaced_in_the_background() -> None:
    assert grade("\\sqrt{8}", "2\\sqrt{2}")
    deadline = time.monotonic() + 60
    while len(POOL.idle_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    frozen = POOL.idle_pids()[-1]  # the next caller takes the last idle worker
    os.kill(frozen, signal.SIGSTOP)  # it can no longer answer, not even at its own deadline
    start = time.monotonic()
    verdict = judge("\\sqrt{12}", "2\\sqrt{3}", timeout=0.5)
    assert verdict.reason == "out of time (0.5 s budget)"
    assert time.monotonic() - start < 0.5 + GRACE_S + 0.25
    start = time.monotonic()
    assert grade("\\sqrt{12}", "2\\sqrt{3}")  # the spare answers: no restart on this call
    assert time.monotonic() - start < 0.5
    assert frozen not in POOL.idle_pids()


def test_budget_holds_for_every_thread() -> None:
    timeout = 0.5
    POOL.reserve(4)
    items = [
        ("(x+1)^{100000}", "(x+1)^{100001}"),
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("9^{9^{9^{9}}}", "1"),
        ("x^2+2x+1", "(x+1)^2"),
    ] * 3

    def timed(item: tuple[str, str]) -> float:
        start = time.monotonic()
        judge(*item, timeout=timeout)
        return time.monotonic() - start

    with ThreadPoolExecutor(max_workers=4) as threads:
        seconds = list(threads.map(timed, items))
    assert max(seconds) <= timeout + 0.5, f"slowest call {max(seconds):.2f} s"


def test_grade_from_a_thread() -> None:
    results: list[bool] = []
    worker = threading.Thread(
        target=lambda: results.extend([grade("\\frac{x}{2}", "0.5x"), grade("x^2", "x^3")])
    )
    worker.start()
    worker.join(timeout=60)
    assert results == [True, False]


def test_grade_from_a_thread_pool() -> None:
    pairs = [("\\sqrt{8}", "2\\sqrt{2}", True), ("x^2", "x^3", False), ("1,000", "1000", True)] * 6
    with ThreadPoolExecutor(max_workers=8) as pool:
        verdicts = list(pool.map(lambda case: grade(case[0], case[1]), pairs))
    assert verdicts == [expected for _, _, expected in pairs]


def test_workers_do_not_outlive_the_interpreter() -> None:
    script = textwrap.dedent(
        """
        from rlvr_fast.grading import grade
        from rlvr_fast.grading.pool import POOL

        if __name__ == "__main__":
            assert grade("\\\\sqrt{8}", "2\\\\sqrt{2}")
            print(*POOL.idle_pids(), flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    worker_pids = [int(pid) for pid in done.stdout.split()]
    assert worker_pids
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(map(_pid_alive, worker_pids)):
        time.sleep(0.05)
    assert not any(map(_pid_alive, worker_pids))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- extract_boxed ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ 7 }", "7"),
        ("nested \\boxed{\\frac{\\sqrt{3}}{2}} end", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\fbox{3}", "3"),
        ("\\boxed{1} and \\fbox{2}", "2"),
        ("\\fbox{2} and \\boxed{1}", "1"),
        ("so $\\boxed 5$.", "5"),
        ("\\boxed {7}", "7"),
        ("\\boxed{1} but then \\boxed{2", None),
        ("\\boxed{\\frac{1}{2}", None),
        ("no box here", None),
        ("", None),
        ("ends with \\boxed", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


# --- passes_gate and grade_response ------------------------------------------------


@pytest.mark.parametrize(
    ("prefix_chars", "expected"),
    [(0, False), (28, False), (29, False), (30, True), (31, True), (200, True)],
)
def test_passes_gate_boundary(prefix_chars: int, expected: bool) -> None:
    text = "x" * prefix_chars + "\\boxed{1}"
    assert text.rfind("\\boxed") == prefix_chars
    assert passes_gate(text) is expected


def test_passes_gate_without_box_and_custom_minimum() -> None:
    assert passes_gate("x" * 100) is False
    assert passes_gate("\\boxed{1}", min_chars=0) is True
    assert passes_gate("ab\\boxed{1}", min_chars=3) is False
    # the last \boxed counts, not the first
    assert passes_gate("\\boxed{1}" + "y" * 30 + "\\boxed{2}") is True


def test_grade_response() -> None:
    response = "We compute carefully and find that the answer is \\boxed{\\dfrac{3}{4}}."
    assert grade_response(response, "0.75") is True
    assert grade_response(response, "0.7") is False
    assert grade_response("no final answer", "0.75") is False
    assert grade_response(response, "0.75", min_chars=30) is True
    assert grade_response("short \\boxed{0.75}", "0.75") is True
    assert grade_response("short \\boxed{0.75}", "0.75", min_chars=30) is False


def test_final_answer_applies_the_gate_and_the_cap() -> None:
    response = "We compute carefully and find that the answer is \\boxed{7}."
    assert final_answer(response) == "7"
    assert final_answer(response, min_chars=30) == "7"
    assert final_answer("short \\boxed{7}", min_chars=30) is None
    assert final_answer("\\boxed{" + "7" * (MAX_ANSWER_CHARS + 1) + "}") is None


def test_judge_response_reasons() -> None:
    assert judge_response("no box", "1").reason == "no \\boxed answer"
    assert judge_response("short \\boxed{1}", "1", min_chars=30).reason == (
        "the last \\boxed starts before char 30 (gate)"
    )
    verdicts = judge_many(["1", None], ["1", "1"])
    assert [v.correct for v in verdicts] == [True, False]
