"""LaTeX -> sympy: our small converter, and sympy equivalence (run inside the worker).

``latex_to_sympy_source`` turns a normalised LaTeX scalar into source for sympy's
``parse_expr`` (``\\frac``, ``\\sqrt``, ``\\sqrt[n]``, ``^``, ``\\cdot``, ``\\times``, ``\\div``,
``\\pi``, ``e``, ``\\infty``, ``\\ln``/``\\log``/``\\exp``/``\\sin``/``\\cos``/``\\tan``, implicit
multiplication); None for anything it does not support.  ``sympy_sources_equal`` parses two
such sources with a whitelist namespace and compares them: constants numerically at 30
digits, with the numeric stage's tolerance when either side holds a decimal and to 1e-20
when both are exact (so ``2^{30}`` is not ``1073741825``); others by ``simplify(a - b) == 0``
or ``a.equals(b)``.  An
undefined value (``zoo``, ``nan``) equals nothing.  Any sympy failure means "not equal".
"""

from __future__ import annotations

import cmath
import re
from typing import TYPE_CHECKING

from rlvr_fast.grading.numeric import ABS_TOL, REL_TOL
from rlvr_fast.grading.tex import CONTROL_WORD, read_argument

if TYPE_CHECKING:
    import sympy

# Two exact constants that agree to this relative precision at 30 digits are equal.
_EXACT_REL_TOL = 1e-20
# Longer scalars are not worth a sympy call: real answers are short, and long ones are slow.
MAX_SYMPY_CHARS = 200

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


def latex_to_sympy_source(latex: str) -> str | None:
    """Source for ``parse_expr`` from a normalised LaTeX scalar; None if unsupported."""
    if len(latex) > MAX_SYMPY_CHARS:
        return None
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
    word = CONTROL_WORD.match(latex, pos)
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
    argument = read_argument(latex, pos)
    if argument is None:
        return None
    converted = _convert_latex(argument[0])
    return None if converted is None else (converted, argument[1])


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


def sympy_sources_equal(first_source: str, second_source: str) -> bool:
    """Whether two sources from ``latex_to_sympy_source`` are the same value (slow: sympy)."""
    import sympy

    try:
        first, second = _parse_sympy(first_source), _parse_sympy(second_source)
        if not isinstance(first, sympy.Expr) or not isinstance(second, sympy.Expr):
            return False
        if first.has(sympy.zoo, sympy.nan) or second.has(sympy.zoo, sympy.nan):
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
    import sympy

    first_value, second_value = first.evalf(30), second.evalf(30)
    if not (first_value.is_finite and second_value.is_finite):
        return False  # equal infinities were already caught by structural equality
    if first.has(sympy.Float) or second.has(sympy.Float):
        return cmath.isclose(
            complex(first_value), complex(second_value), rel_tol=REL_TOL, abs_tol=ABS_TOL
        )
    difference, scale = abs(first_value - second_value), max(abs(first_value), abs(second_value))
    return bool(difference <= _EXACT_REL_TOL * scale)
