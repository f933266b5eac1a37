"""Tests for rlvr_fast.grading: boxed extraction, the length gate and answer equivalence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlvr_fast import grading
from rlvr_fast.grading import extract_boxed, grade, grade_response, passes_gate

REPO_ROOT = Path(__file__).resolve().parents[1]

# (prediction, gold, expected). The False rows are false positives a lax grader makes.
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
    ("(1,2)", "1,2", False),
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
]


@pytest.mark.parametrize(("pred", "gold", "expected"), GRADE_CASES)
def test_grade_table(pred: str, gold: str, expected: bool) -> None:
    assert grade(pred, gold) is expected


@pytest.mark.parametrize(("pred", "gold", "expected"), GRADE_CASES)
def test_grade_is_symmetric(pred: str, gold: str, expected: bool) -> None:
    assert grade(gold, pred) is expected


def test_grade_none_or_empty_is_false() -> None:
    assert grade(None, "5") is False
    assert grade("", "") is False
    assert grade("$ $", "") is False


def test_second_opinion_never_turns_a_wrong_answer_right() -> None:
    # With math-verify installed or not, a clearly wrong answer stays wrong.
    assert grade("3", "5", second_opinion=True) is False
    assert grade("\\frac{1}{2}", "0.5", second_opinion=True) is True


def test_long_inputs_skip_sympy() -> None:
    under_limit = "+".join(["x"] * 50)
    over_limit = "+".join(["x"] * 101)
    assert len(under_limit) <= grading.MAX_SYMPY_CHARS < len(over_limit)
    assert grade(under_limit, "50x") is True
    assert grade(over_limit, "101x") is False


def test_cheap_stages_do_not_start_the_worker() -> None:
    grading._WORKER.close()
    for pred, gold in [
        ("1,000", "1000"),
        ("12", "1.2"),
        ("\\frac{1}{2}", "0.5"),
        ("A", "B"),
        ("Monday", "5"),
    ]:
        grade(pred, gold)
    grade_response("so \\boxed{(1, 2)}", "(2,1)")
    assert grading._WORKER._process is None


# --- timeout and threads -------------------------------------------------------


def test_pathological_sympy_input_times_out_and_worker_recovers() -> None:
    assert grade("\\sqrt{8}", "2\\sqrt{2}")  # start the worker outside the timed part
    start = time.monotonic()
    verdict = grade("(x+1)^{100000}", "(x+1)^{100001}", timeout=0.5)
    elapsed = time.monotonic() - start
    assert verdict is False
    assert elapsed < 0.5 + 1.0
    assert grade("\\sqrt{8}", "2\\sqrt{2}")  # a fresh worker answers again


def test_zero_timeout_skips_sympy() -> None:
    assert grade("\\sqrt{8}", "2\\sqrt{2}", timeout=0.0) is False
    assert grade("1,000", "1000", timeout=0.0) is True


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


def test_worker_does_not_outlive_the_interpreter() -> None:
    script = textwrap.dedent(
        """
        from rlvr_fast import grading

        if __name__ == "__main__":
            assert grading.grade("\\\\sqrt{8}", "2\\\\sqrt{2}")
            print(grading._WORKER._process.pid, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    worker_pid = int(done.stdout.strip())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _pid_alive(worker_pid):
        time.sleep(0.05)
    assert not _pid_alive(worker_pid)


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
