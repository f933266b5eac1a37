"""Our own answer-equivalence pipeline over normalised, parsed answers.

Stages, cheapest first: string equality after normalisation; numeric equality of plain
numbers (see ``numeric``); sympy equivalence of scalars, through ``sympy_equal`` (the
worker's, or None in the caller, which only records that sympy would be needed).  Compound
answers compare item by item with the same stages: ordered kinds position by position,
unordered kinds as sets (each item has an equal item on the other side; repeats collapse),
labels must agree when both items carry one.  Answers made only of letters are text: two
such answers are compared case-insensitively and a text answer of two or more letters never
equals a non-text answer.

Some False outcomes are *definite*: no second opinion may overturn them (an empty or
undefined answer; two different plain numbers, or compounds of one kind made only of plain
numbers; two different words, or a text answer against a non-text one).  Two plain numbers are
decided exactly here, and the MATH convention ``50\\%`` == ``50`` holds in every mode that runs
our pipeline.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from rlvr_fast.grading.latex_sympy import latex_to_sympy_source
from rlvr_fast.grading.normalisation import normalize
from rlvr_fast.grading.numeric import has_zero_denominator, numbers_equal, parse_number
from rlvr_fast.grading.structure import UNORDERED_KINDS, Answer, parse_answer

SympyEqual = Callable[[str, str], bool]

_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Outcome:
    """Our pipeline's verdict with its reason; see the module doc for ``definite``."""

    equal: bool
    reason: str
    definite: bool = False
    needs_sympy: bool = False  # a scalar pair was left to sympy, which was not run


def compare_answers(pred: str, gold: str, sympy_equal: SympyEqual | None) -> Outcome:
    """Whether ``pred`` and ``gold`` (extracted answers, within the size cap) are equivalent."""
    pred_norm, gold_norm = normalize(pred), normalize(gold)
    if not pred_norm or not gold_norm:
        return Outcome(False, "empty answer", definite=True)
    if has_zero_denominator(pred_norm) or has_zero_denominator(gold_norm):
        return Outcome(False, "undefined value (zero denominator)", definite=True)
    if pred_norm == gold_norm:
        return Outcome(True, "equal after normalisation")
    first, second = parse_answer(pred_norm), parse_answer(gold_norm)
    if first.kind == second.kind == "scalar" and (
        outcome := _plain_scalars(first.text, second.text)
    ):
        return outcome
    matcher = _Matcher(sympy_equal)
    if matcher.answers_equal(first, second):
        return Outcome(True, "equal by sympy" if matcher.used_sympy else "equal item by item")
    if first.kind == second.kind and _only_numbers(first) and _only_numbers(second):
        return Outcome(False, "different numbers", definite=True)
    return Outcome(False, "not equivalent", needs_sympy=matcher.needs_sympy)


def _plain_scalars(first: str, second: str) -> Outcome | None:
    """The outcome for two scalars that are plain numbers or words; None when sympy may help."""
    if (equal := numbers_equal(first, second)) is not None:
        if equal:
            return Outcome(True, "equal as numbers")
        return Outcome(False, "different numbers", definite=True)
    first_is_word, second_is_word = bool(_WORD.fullmatch(first)), bool(_WORD.fullmatch(second))
    if first_is_word and second_is_word:
        if first.casefold() == second.casefold():
            return Outcome(True, "equal as text")
        return Outcome(False, "different text", definite=True)
    # A word of two or more letters is a text answer ("Monday"), which no expression equals.
    if (first_is_word and len(first) > 1) or (second_is_word and len(second) > 1):
        return Outcome(False, "text against a non-text answer", definite=True)
    return None


def _only_numbers(answer: Answer) -> bool:
    """Whether every scalar in ``answer`` is a plain number (our comparison is then exact)."""
    if answer.kind == "scalar":
        return parse_number(answer.text) is not None
    return all(_only_numbers(item) for item in answer.items)


class _Matcher:
    """One comparison's item-by-item walk; remembers whether sympy was used or needed."""

    def __init__(self, sympy_equal: SympyEqual | None) -> None:
        self.sympy_equal = sympy_equal
        self.used_sympy = False
        self.needs_sympy = False

    def answers_equal(self, first: Answer, second: Answer) -> bool:
        if first.label and second.label and first.label != second.label:
            return False
        if first.kind != second.kind:
            return False
        if first.kind == "scalar":
            return self.scalars_equal(first.text, second.text)
        if first.kind in UNORDERED_KINDS:
            return self._same_members(first.items, second.items)
        return len(first.items) == len(second.items) and all(
            self.answers_equal(a, b) for a, b in zip(first.items, second.items)
        )

    def _same_members(self, firsts: tuple[Answer, ...], seconds: tuple[Answer, ...]) -> bool:
        """Set equality: every item on each side equals some item on the other side."""
        equal: dict[tuple[int, int], bool] = {}

        def pair_equal(i: int, j: int) -> bool:
            if (i, j) not in equal:
                equal[i, j] = self.answers_equal(firsts[i], seconds[j])
            return equal[i, j]

        rows, columns = range(len(firsts)), range(len(seconds))
        return all(any(pair_equal(i, j) for j in columns) for i in rows) and all(
            any(pair_equal(i, j) for i in rows) for j in columns
        )

    def scalars_equal(self, first: str, second: str) -> bool:
        if first == second:
            return True
        if (outcome := _plain_scalars(first, second)) is not None:
            return outcome.equal
        first_source, second_source = latex_to_sympy_source(first), latex_to_sympy_source(second)
        if first_source is None or second_source is None:
            return False
        if self.sympy_equal is None:
            self.needs_sympy = True
            return False
        equal = self.sympy_equal(first_source, second_source)
        self.used_sympy |= equal
        return equal
