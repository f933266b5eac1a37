"""Answer extraction and answer-equivalence grading for math RLVR rewards.

What is implemented here, exactly:

* ``extract_boxed`` -- the content of the last ``\\boxed{...}`` or ``\\fbox{...}``
  (whichever starts last), braces matched with nesting, surrounding whitespace
  stripped; the LaTeX shorthand ``\\boxed 5`` (a space, then a token up to
  whitespace or ``$``) is accepted too.  ``None`` when there is no box or the last
  box's braces never close.
* ``passes_gate`` -- the seed's length gate, exactly ``text.rfind("\\boxed") >= min_chars``.
* ``grade`` -- whether an extracted answer is equivalent to the gold answer:

  1. string equality after normalisation (list below);
  2. numeric equality of plain numbers (integers, decimals, ``a/b`` and
     ``\\frac{a}{b}`` of those), with ``math.isclose`` semantics: relative 1e-6,
     absolute 1e-9;
  3. sympy equivalence as the last resort: our own small LaTeX converter turns both
     sides into sympy source (``\\frac``, ``\\sqrt``, ``\\sqrt[n]``, ``^``, ``\\cdot``,
     ``\\times``, ``\\pi``, ``e``, ``\\infty``, ``\\ln``/``\\log``/``\\exp``/``\\sin``/
     ``\\cos``/``\\tan``, implicit multiplication), parsed by ``parse_expr`` with a
     whitelist namespace.  Constant expressions are compared numerically with the
     tolerance above, others by ``simplify(a - b) == 0`` or ``a.equals(b)``.
     Conversion or parse failures mean "not equivalent", never an exception.

  Compound answers are compared element by element with the same three stages:
  tuples and intervals need the same bracket pair (``(1, 2)`` is also the open
  interval, ``[0, 1)`` differs from ``(0, 1)``), sets ``\\{...\\}``, unions joined
  by ``\\cup`` and bare comma lists (``1, 2``: a list of solutions) are unordered,
  ``pmatrix``/``bmatrix`` need the same shape.
  ``grade(..., second_opinion=True)`` also asks the optional ``math-verify``
  package when our pipeline says False and the package is installed.
* ``grade_response`` -- ``extract_boxed`` then ``grade``, optionally gated by
  ``passes_gate``.

Normalisation (applied to both sides): surrounding/escaped ``$``; ``\\left``/
``\\right``/``\\big``-style sizing and ``\\displaystyle``; the spacing commands
``\\!``, ``\\,``, ``\\;``, ``\\:``, ``\\ ``, ``\\quad``, ``~``; a trailing period;
``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\inf``, ``∞``, ``π``, unicode minus;
``bmatrix`` -> ``pmatrix``; degrees (``^\\circ``, ``^{\\circ}``, ``°``, ``\\degree``);
percent signs (``50\\%`` equals ``50``, the MATH convention, and NOT ``0.5``); units
in a trailing ``\\text{...}``/``\\mbox{...}`` (``5 \\text{ cm}``) or as trailing words
after a number (``10 dollars``); other ``\\text``/``\\textbf``/``\\mathrm``-style
wrappers are unwrapped (``\\text{(A)}`` -> ``(A)``); a leading single-variable
assignment (``x =``, ``k=``, ``x_1 =``); thousands separators (a digit group
followed only by ``,ddd`` groups, so ``1,000,000`` is one number while ``(1, 2)``
and ``(1,2)`` stay tuples; ``(1,000)`` is read as 1000); whitespace;
``\\frac12``/``\\frac1{2}``/``\\sqrt2`` shorthand -> braced arguments; ``.5`` -> ``0.5``.
Answers made only of letters are text: two such answers are compared
case-insensitively (``\\text{Monday}`` == ``monday``) and a text answer of two or
more letters never equals a non-text answer.

The sympy stage runs in one persistent worker process (multiprocessing "spawn"
context: safe with threads and CUDA), started lazily on the first answer the cheap
stages cannot decide, reused across calls, serialised by a lock so any thread may
call ``grade``, and killed (then restarted on the next need) when a request
outlives its budget.  Each ``grade`` call may spend at most ``timeout`` seconds
(default 2.0) of worker time in total, second opinion included; a call that runs
out answers False.  Worker start-up and waiting for the lock behind other threads
do not count against the budget, so grades do not depend on machine load.  Inputs
longer than 200 characters skip sympy; answers longer than 1000 characters count
only on an exact string match.  Because the worker is spawned, scripts that call
``grade`` need the usual ``if __name__ == "__main__":`` guard; ``grade`` raises
(RuntimeError) only when the worker cannot start at all.
"""

from __future__ import annotations

import atexit
import cmath
import functools
import importlib.util
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sympy

__all__ = [
    "ABS_TOL",
    "DEFAULT_TIMEOUT_S",
    "MAX_SYMPY_CHARS",
    "REL_TOL",
    "extract_boxed",
    "grade",
    "grade_response",
    "passes_gate",
]

DEFAULT_TIMEOUT_S = 2.0
REL_TOL = 1e-6
ABS_TOL = 1e-9
MAX_SYMPY_CHARS = 200

# Beyond this length an answer is garbage for grading purposes; only an exact match
# counts, which also keeps the recursive helpers far from Python's recursion limit.
_MAX_ANSWER_CHARS = 1000
# Spawning a fresh interpreter that imports sympy takes seconds on a loaded machine.
_WORKER_START_TIMEOUT_S = 120.0
_WORKER_READY = "ready"


# --------------------------------------------------------------------------- boxes


_BOX_COMMANDS = ("\\boxed", "\\fbox")
_SPACES = re.compile(r" +")
_SHORTHAND_TOKEN = re.compile(r"[^\s$]+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text``, or None."""
    start, command = max((text.rfind(command), command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    return _read_box_argument(text, start + len(command))


def _read_box_argument(text: str, pos: int) -> str | None:
    after_spaces = _SPACES.match(text, pos)
    arg_pos = after_spaces.end() if after_spaces else pos
    if text.startswith("{", arg_pos):
        group = _read_braced(text, arg_pos)
        return None if group is None else group[0].strip()
    if after_spaces is None:
        return None  # e.g. "\boxedx" or "\boxed" at the very end: not a box
    token = _SHORTHAND_TOKEN.match(text, arg_pos)
    return token.group(0) if token else None


def _read_braced(text: str, open_pos: int) -> tuple[str, int] | None:
    """(content, index after the closing brace) of the group opening at open_pos."""
    depth = 0
    pos = open_pos
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2  # an escaped char (\{, \}, \\) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : pos], pos + 1
        pos += 1
    return None


def passes_gate(text: str, min_chars: int = 30) -> bool:
    """The seed's gate: the last ``\\boxed`` starts at index ``min_chars`` or later."""
    return text.rfind("\\boxed") >= min_chars


def grade_response(response_text: str, gold: str, *, min_chars: int | None = None) -> bool:
    """Grade the last boxed answer of a full response; optionally apply the gate first."""
    if min_chars is not None and not passes_gate(response_text, min_chars):
        return False
    return grade(extract_boxed(response_text), gold)


# ------------------------------------------------------------------- normalisation


_SIZING = re.compile(
    r"\\(?:left|right)(?:\.|(?![a-zA-Z]))|\\(?:[bB]igg?[lr]?|displaystyle)(?![a-zA-Z])"
)
# "\\\\" (a matrix row break) is matched first so that "\\ " is not read as "\ ".
_SPACING = re.compile(r"\\\\|\\[,;:> !]|\\q?quad(?![a-zA-Z])|~")
_FRAC_VARIANT = re.compile(r"\\[dt]frac(?![a-zA-Z])")
_INF = re.compile(r"\\inf(?![a-zA-Z])")
_SYMBOL_SPELLINGS = {
    "∞": "\\infty",
    "π": "\\pi",
    "−": "-",
    "×": "\\times",
    "·": "\\cdot",
    "\\varnothing": "\\emptyset",
    "bmatrix": "pmatrix",
    "{,}": ",",
}
_DEGREES_AND_PERCENT = re.compile(
    r"\^\s*(?:\{\s*\\circ\s*\}|\\circ(?![a-zA-Z]))|°|\\degree(?![a-zA-Z])|\\?%"
)
# A trailing text block after some value is a unit when it is words that either start
# with a space ("5 \text{ m}") or have two or more letters ("5\mbox{cm}"); this keeps
# "3 + 2\mathrm{i}" intact.
_TEXT_UNIT = re.compile(
    r"(?P<value>.*\S)\s*\\(?:text|textrm|textnormal|mbox|mathrm)\s*"
    r"\{(?:\s+[A-Za-z][A-Za-z .]*|[A-Za-z]{2}[A-Za-z .]*)\}(?:\^\{?\d\}?)?"
)
_TEXT_WRAPPER = re.compile(
    r"\\(?:text(?:bf|it|rm|normal)?|math(?:rm|bf|it)|mbox|operatorname)\s*(?=\{)"
)
_LEADING_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=(?!=)\s*")
_WORD_UNITS = re.compile(r"(?<=[\d}])\s+[A-Za-z]{2,}[A-Za-z.]*(?:\s+[A-Za-z.]+)*$")
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?!\d|,\d)")
# Whitespace is dropped, except one space that ends a control word before a letter
# ("\pi r" must not become "\pir").
_WHITESPACE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])|\s+")
_FRAC_OR_SQRT = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
_CONTROL_WORD = re.compile(r"\\(?:[a-zA-Z]+|.)")
_BARE_DECIMAL_POINT = re.compile(r"(?<!\d)\.(?=\d)")


def _normalize(answer: str) -> str:
    text = answer.strip()
    for step in _NORMALIZATION_STEPS:
        text = step(text)
    return text


def _remove_dollars(text: str) -> str:
    return text.replace("\\$", "").replace("$", "")


def _remove_sizing_and_spacing(text: str) -> str:
    text = _SIZING.sub("", text)
    return _SPACING.sub(_spacing_replacement, text)


def _spacing_replacement(match: re.Match[str]) -> str:
    command = match.group(0)
    if command == "\\\\":
        return command
    return "" if command == "\\!" else " "


def _remove_trailing_period(text: str) -> str:
    return text.strip().rstrip(".").rstrip()


def _unify_spellings(text: str) -> str:
    text = _FRAC_VARIANT.sub(r"\\frac", text)
    text = _INF.sub(r"\\infty", text)
    for spelling, canonical in _SYMBOL_SPELLINGS.items():
        text = text.replace(spelling, canonical)
    return text


def _remove_degrees_and_percent(text: str) -> str:
    return _DEGREES_AND_PERCENT.sub("", text)


def _remove_text_unit(text: str) -> str:
    match = _TEXT_UNIT.fullmatch(text)
    return match.group("value") if match else text


def _unwrap_text_commands(text: str) -> str:
    while match := _TEXT_WRAPPER.search(text):
        group = _read_braced(text, match.end())
        if group is None:
            return text
        content, end = group
        text = text[: match.start()] + content + text[end:]
    return text


def _remove_leading_variable(text: str) -> str:
    return _LEADING_VARIABLE.sub("", text, count=1)


def _remove_word_units(text: str) -> str:
    return _WORD_UNITS.sub("", text)


def _remove_thousands_separators(text: str) -> str:
    return _THOUSANDS.sub(lambda match: match.group(0).replace(",", ""), text)


def _collapse_whitespace(text: str) -> str:
    return _WHITESPACE.sub(lambda match: match.group(1) + " " if match.group(1) else "", text)


def _expand_shorthand_arguments(text: str) -> str:
    """Brace every argument of ``\\frac`` and ``\\sqrt``: ``\\frac12`` -> ``\\frac{1}{2}``."""
    parts: list[str] = []
    pos = 0
    while match := _FRAC_OR_SQRT.search(text, pos):
        parts.append(text[pos : match.end()])
        pos = match.end()
        if match.group(1) == "sqrt" and text.startswith("[", pos):
            close = text.find("]", pos)
            if close < 0:
                break
            parts.append(text[pos : close + 1])
            pos = close + 1
        for _ in range(2 if match.group(1) == "frac" else 1):
            argument = _read_argument(text, pos)
            if argument is None:
                break
            content, pos = argument
            parts.append("{" + _expand_shorthand_arguments(content) + "}")
    parts.append(text[pos:])
    return "".join(parts)


def _read_argument(text: str, pos: int) -> tuple[str, int] | None:
    """One TeX macro argument at pos: a braced group, a control word or one character."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        return _read_braced(text, pos)
    if text[pos] == "\\":
        word = _CONTROL_WORD.match(text, pos)
        return (word.group(0), word.end()) if word else None
    return text[pos], pos + 1


def _add_leading_zero(text: str) -> str:
    return _BARE_DECIMAL_POINT.sub("0.", text)


_NORMALIZATION_STEPS = (
    _remove_dollars,
    _remove_sizing_and_spacing,
    _remove_trailing_period,
    _unify_spellings,
    _remove_degrees_and_percent,
    _remove_text_unit,
    _unwrap_text_commands,
    _remove_leading_variable,
    _remove_word_units,
    # before whitespace goes, so that "(1, 234)" stays a pair
    _remove_thousands_separators,
    _collapse_whitespace,
    _expand_shorthand_arguments,
    _add_leading_zero,
)


# ----------------------------------------------------------------------- structure


_UNORDERED_KINDS = frozenset({"set", "union"})
_MATRIX = re.compile(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}")


@dataclass(frozen=True)
class _Answer:
    """A normalised answer: a scalar, or a compound whose kind fixes how items compare."""

    kind: str  # "scalar", "set", "union", "matrix(rows...)" or a bracket pair like "[)"
    text: str = ""  # the scalar itself (kind == "scalar" only)
    items: tuple[_Answer, ...] = ()


def _parse_answer(text: str) -> _Answer:
    if (rows := _matrix_rows(text)) is not None:
        shape = tuple(len(row) for row in rows)
        return _Answer(f"matrix{shape}", items=_parse_items(cell for row in rows for cell in row))
    if text.startswith("\\{") and text.endswith("\\}") and _closing_index(text, 1) == len(text) - 1:
        return _Answer("set", items=_parse_items(_split_top_level(text[2:-2], ",")))
    if len(union := _split_top_level(text, "\\cup")) > 1:
        return _Answer("union", items=_parse_items(union))
    if _is_bracketed(text):
        elements = _split_top_level(text[1:-1], ",")
        if len(elements) > 1:
            return _Answer(text[0] + text[-1], items=_parse_items(elements))
        if text[0] == "(" and text[-1] == ")":
            return _parse_answer(text[1:-1])
    if len(elements := _split_top_level(text, ",")) > 1:
        return _Answer("set", items=_parse_items(elements))
    return _Answer("scalar", text=text)


def _parse_items(texts: Iterable[str]) -> tuple[_Answer, ...]:
    return tuple(_parse_answer(text) for text in texts)


def _matrix_rows(text: str) -> list[list[str]] | None:
    match = _MATRIX.fullmatch(text)
    if match is None:
        return None
    rows = _split_top_level(match.group(1), "\\\\")
    if rows and not rows[-1]:
        rows.pop()  # a trailing "\\" before \end ends the last row, it opens no new one
    return [_split_top_level(row, "&") for row in rows]


def _is_bracketed(text: str) -> bool:
    return (
        len(text) >= 2
        and text[0] in "(["
        and text[-1] in ")]"
        and _closing_index(text, 0) == len(text) - 1
    )


def _closing_index(text: str, open_pos: int) -> int:
    """Index of the bracket closing the one at open_pos, any bracket type (so "[0,1)" works)."""
    depth = 0
    for pos in range(open_pos, len(text)):
        if text[pos] in "([{":
            depth += 1
        elif text[pos] in ")]}":
            depth -= 1
            if depth == 0:
                return pos
    return -1


def _split_top_level(text: str, separator: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = pos = 0
    while pos < len(text):
        if text[pos] in "([{":
            depth += 1
        elif text[pos] in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, pos):
            parts.append(text[start:pos])
            pos += len(separator)
            start = pos
            continue
        pos += 1
    parts.append(text[start:])
    return parts


# ----------------------------------------------------------------------- comparing


@dataclass
class _Budget:
    """Seconds of worker time one ``grade`` call may still spend."""

    remaining: float


def grade(
    pred_text: str | None,
    gold: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    second_opinion: bool = False,
) -> bool:
    """True when the extracted answer ``pred_text`` is equivalent to ``gold``."""
    if pred_text is None:
        return False
    budget = _Budget(timeout)
    if _answers_equivalent(pred_text, gold, budget):
        return True
    return (
        second_opinion
        and _math_verify_installed()
        and _WORKER.ask(("math_verify", pred_text, gold), budget)
    )


def _answers_equivalent(pred: str, gold: str, budget: _Budget) -> bool:
    if len(pred) > _MAX_ANSWER_CHARS or len(gold) > _MAX_ANSWER_CHARS:
        return pred.strip() == gold.strip()
    pred_norm, gold_norm = _normalize(pred), _normalize(gold)
    if not pred_norm or not gold_norm:
        return False
    if pred_norm == gold_norm:
        return True
    return _compounds_equal(_parse_answer(pred_norm), _parse_answer(gold_norm), budget)


def _compounds_equal(first: _Answer, second: _Answer, budget: _Budget) -> bool:
    if first.kind != second.kind or len(first.items) != len(second.items):
        return False
    if first.kind == "scalar":
        return _scalars_equal(first.text, second.text, budget)
    if first.kind in _UNORDERED_KINDS:
        return _all_matched(first.items, second.items, budget)
    return all(_compounds_equal(a, b, budget) for a, b in zip(first.items, second.items))


def _all_matched(firsts: tuple[_Answer, ...], seconds: tuple[_Answer, ...], budget: _Budget) -> bool:
    """Unordered comparison: each item pairs off with a distinct equal item."""
    unmatched = list(seconds)
    for item in firsts:
        index = next(
            (i for i, other in enumerate(unmatched) if _compounds_equal(item, other, budget)), None
        )
        if index is None:
            return False
        del unmatched[index]
    return True


_WORD = re.compile(r"[A-Za-z]+")


def _scalars_equal(first: str, second: str, budget: _Budget) -> bool:
    if first == second:
        return True
    if not first or not second:
        return False
    first_is_word, second_is_word = bool(_WORD.fullmatch(first)), bool(_WORD.fullmatch(second))
    if first_is_word and second_is_word:
        return first.casefold() == second.casefold()
    # A word of two or more letters is a text answer ("Monday"), which no expression equals.
    if (first_is_word and len(first) > 1) or (second_is_word and len(second) > 1):
        return False
    first_number, second_number = _parse_number(first), _parse_number(second)
    if first_number is not None and second_number is not None:
        return _numbers_close(first_number, second_number)
    return _sympy_equal(first, second, budget)


# The exponent is capped so that a literal like 1e999999999 cannot stall the caller.
_DECIMAL = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?"
_PLAIN_NUMBER = re.compile(_DECIMAL)
_SLASH_FRACTION = re.compile(rf"({_DECIMAL})/({_DECIMAL})")
_LATEX_FRACTION = re.compile(rf"([-+]?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}")


def _parse_number(text: str) -> Fraction | None:
    """Exact value of a plain number, ``a/b`` or ``\\frac{a}{b}``; None for anything else."""
    try:
        if _PLAIN_NUMBER.fullmatch(text):
            return Fraction(text)
        if match := _SLASH_FRACTION.fullmatch(text):
            return Fraction(match.group(1)) / Fraction(match.group(2))
        if match := _LATEX_FRACTION.fullmatch(text):
            value = Fraction(match.group(2)) / Fraction(match.group(3))
            return -value if match.group(1) == "-" else value
    except (ValueError, ZeroDivisionError):  # over-long digit strings, zero denominators
        return None
    return None


def _numbers_close(first: Fraction, second: Fraction) -> bool:
    # Exact Fraction arithmetic: floats would overflow on huge integers.
    scale = max(abs(first), abs(second))
    return abs(first - second) <= max(Fraction(REL_TOL) * scale, Fraction(ABS_TOL))


def _sympy_equal(first: str, second: str, budget: _Budget) -> bool:
    if len(first) > MAX_SYMPY_CHARS or len(second) > MAX_SYMPY_CHARS:
        return False
    first_source, second_source = _latex_to_sympy_source(first), _latex_to_sympy_source(second)
    if first_source is None or second_source is None:
        return False
    return _WORKER.ask(("sympy", first_source, second_source), budget)


# ------------------------------------------------------------ LaTeX -> sympy source


_COMMAND_SOURCE = {
    "pi": " pi ",
    "infty": " oo ",
    "cdot": "*",
    "times": "*",
    "div": "/",
    "ln": " log ",
    "log": " log ",
    "exp": " exp ",
    "sin": " sin ",
    "cos": " cos ",
    "tan": " tan ",
}
_LETTERS = re.compile(r"[A-Za-z]+")
# parse_expr evaluates its input: allow only arithmetic over names and numbers (no
# underscores, quotes, brackets or attribute access), so nothing but sympy runs.
_SAFE_SOURCE = re.compile(r"[A-Za-z0-9+\-*/^().! ]+")
_ATTRIBUTE_DOT = re.compile(r"\.(?!\d)")


def _latex_to_sympy_source(latex: str) -> str | None:
    """Source for ``parse_expr`` from a normalised LaTeX scalar; None if unsupported."""
    source = _convert_latex(latex)
    if source is None or not _SAFE_SOURCE.fullmatch(source) or _ATTRIBUTE_DOT.search(source):
        return None
    return source


def _convert_latex(latex: str) -> str | None:
    parts: list[str] = []
    pos = 0
    while pos < len(latex):
        char = latex[pos]
        if char == "\\":
            converted = _convert_command(latex, pos)
            if converted is None:
                return None
            source, pos = converted
            parts.append(source)
        elif letters := _LETTERS.match(latex, pos):
            # A lone "e" is Euler's number; spaces keep "2x" from reading as one token.
            word = letters.group(0)
            parts.append(" E " if word == "e" else f" {word} ")
            pos = letters.end()
        else:
            parts.append({"{": "(", "}": ")"}.get(char, char))
            pos += 1
    return "".join(parts)


def _convert_command(latex: str, pos: int) -> tuple[str, int] | None:
    word = _CONTROL_WORD.match(latex, pos)
    if word is None:
        return None
    name, pos = word.group(0)[1:], word.end()
    if name in _COMMAND_SOURCE:
        return _COMMAND_SOURCE[name], pos
    if name == "frac":
        return _convert_fraction(latex, pos)
    if name == "sqrt":
        return _convert_root(latex, pos)
    return None


def _convert_fraction(latex: str, pos: int) -> tuple[str, int] | None:
    numerator = _read_converted_argument(latex, pos)
    if numerator is None:
        return None
    denominator = _read_converted_argument(latex, numerator[1])
    if denominator is None:
        return None
    return f"(({numerator[0]})/({denominator[0]}))", denominator[1]


def _convert_root(latex: str, pos: int) -> tuple[str, int] | None:
    degree = None
    if latex.startswith("[", pos):
        close = latex.find("]", pos)
        degree = _convert_latex(latex[pos + 1 : close]) if close > 0 else None
        if degree is None:
            return None
        pos = close + 1
    radicand = _read_converted_argument(latex, pos)
    if radicand is None:
        return None
    if degree is None:
        return f" sqrt({radicand[0]})", radicand[1]
    return f"(({radicand[0]})**(1/({degree})))", radicand[1]


def _read_converted_argument(latex: str, pos: int) -> tuple[str, int] | None:
    argument = _read_argument(latex, pos)
    if argument is None:
        return None
    converted = _convert_latex(argument[0])
    return None if converted is None else (converted, argument[1])


# -------------------------------------------------------------- the worker process


class _SympyWorker:
    """A lazily started, reused sympy process; killed on any timeout or crash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    def ask(self, request: tuple[str, str, str], budget: _Budget) -> bool:
        """The worker's verdict on ``(kind, first, second)``, False when over budget."""
        with self._lock:
            if budget.remaining <= 0:
                return False
            conn = self._running_connection()
            started = time.monotonic()
            try:
                conn.send(request)
                if conn.poll(budget.remaining):
                    return bool(conn.recv())
            except (EOFError, OSError):  # the worker died (e.g. out of memory)
                pass
            finally:
                budget.remaining -= time.monotonic() - started
            self._stop()
            return False

    def close(self) -> None:
        with self._lock:
            self._stop()

    def forget_after_fork(self) -> None:
        # A forked child must neither use nor kill its parent's worker.
        self._lock = threading.Lock()
        self._process = None
        self._conn = None

    def _running_connection(self) -> Connection:
        if self._process is not None and self._conn is not None and self._process.is_alive():
            return self._conn
        self._stop()
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        process = context.Process(
            target=_serve_requests, args=(child_conn,), name="rlvr-grading-sympy", daemon=True
        )
        process.start()
        child_conn.close()
        self._process, self._conn = process, parent_conn
        try:
            ready = parent_conn.poll(_WORKER_START_TIMEOUT_S) and parent_conn.recv() == _WORKER_READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._stop()
            raise RuntimeError(
                "the sympy grading worker process failed to start; a script that calls "
                "grade() needs an `if __name__ == '__main__':` guard (spawn re-imports it)"
            )
        return parent_conn

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = None
        self._conn = None


def _serve_requests(conn: Connection) -> None:
    """Worker main loop: answer ``(kind, first, second)`` until the parent hangs up."""
    handlers = {"sympy": _sympy_equivalent, "math_verify": _math_verify_equivalent}
    _sympy_equivalent("1", "1")  # import and warm sympy before reporting ready
    conn.send(_WORKER_READY)
    while True:
        try:
            kind, first, second = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(handlers[kind](first, second))


# What parse_expr's transformations emit (Integer, Float, Rational, Symbol, Function,
# factorial) plus the functions and constants our converter produces.
_SYMPY_NAMES = (
    "Integer",
    "Float",
    "Rational",
    "Symbol",
    "Function",
    "factorial",
    "sqrt",
    "pi",
    "E",
    "oo",
    "exp",
    "log",
    "sin",
    "cos",
    "tan",
)


def _sympy_equivalent(first_source: str, second_source: str) -> bool:
    """Runs in the worker: sympy equivalence of two sources from ``_latex_to_sympy_source``."""
    import sympy

    try:
        first, second = _parse_sympy(first_source), _parse_sympy(second_source)
        if not isinstance(first, sympy.Expr) or not isinstance(second, sympy.Expr):
            return False
        if first == second:
            return True
        if not first.free_symbols and not second.free_symbols:
            return _constants_close(first, second)
        return sympy.simplify(first - second) == 0 or first.equals(second) is True
    except Exception:  # sympy raises many exception types on odd input; all mean "no"
        return False


def _parse_sympy(source: str) -> sympy.Basic:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    # Unknown names become Symbols; only the whitelisted sympy names are callable.
    namespace = {name: getattr(sympy, name) for name in _SYMPY_NAMES}
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr(source, local_dict={}, global_dict=namespace, transformations=transformations)


def _constants_close(first: sympy.Expr, second: sympy.Expr) -> bool:
    first_value, second_value = complex(first.evalf(30)), complex(second.evalf(30))
    if not (cmath.isfinite(first_value) and cmath.isfinite(second_value)):
        return False  # equal infinities were already caught by structural equality
    return cmath.isclose(first_value, second_value, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _math_verify_equivalent(pred: str, gold: str) -> bool:
    """Runs in the worker: math-verify's verdict, False if it is missing or fails."""
    try:
        from math_verify import parse, verify

        return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")))
    except Exception:  # a second opinion must never break grading
        return False


@functools.cache
def _math_verify_installed() -> bool:
    return importlib.util.find_spec("math_verify") is not None


_WORKER = _SympyWorker()
atexit.register(_WORKER.close)
os.register_at_fork(after_in_child=_WORKER.forget_after_fork)
