"""Plain numbers: exact values, closeness, and undefined values.

``parse_number`` reads integers, decimals, ``a/b``, ``\\frac{a}{b}`` of those and mixed
numbers (``2\\frac{1}{4}`` is 9/4: a whole number directly followed by a proper fraction) as
exact ``Fraction``s.  ``numbers_equal``: two numbers written exactly (integers, fractions) must
be equal; when either is a decimal (a rounded value, ``0.333333``) they are equal with
``math.isclose`` semantics (relative 1e-6, absolute 1e-9), computed exactly.  A literal zero
denominator (``\\frac{1}{0}``, ``1/0``) makes an answer undefined: it equals nothing, itself
included.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlvr_fast.grading.tex import read_argument

REL_TOL = 1e-6
ABS_TOL = 1e-9

# The exponent is capped so that a literal like 1e999999999 cannot stall the caller.
_DECIMAL = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?"
_PLAIN_NUMBER = re.compile(_DECIMAL, re.ASCII)
_SLASH_FRACTION = re.compile(rf"({_DECIMAL})/({_DECIMAL})", re.ASCII)
_LATEX_FRACTION = re.compile(rf"([-+]?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}", re.ASCII)
_MIXED_NUMBER = re.compile(r"([-+]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}", re.ASCII)
_ZERO = re.compile(r"[-+]?(?:0+\.?0*|\.0+)", re.ASCII)
_SLASH_ZERO = re.compile(r"/[-+]?(?:0+\.?0*|\.0+)(?![\d.])", re.ASCII)
_FRAC = re.compile(r"\\frac(?![a-zA-Z])")
_DECIMAL_MARK = re.compile(r"[.eE]")


def parse_number(text: str) -> Fraction | None:
    """Exact value of a plain number, ``a/b``, ``\\frac{a}{b}`` or a mixed number; else None."""
    try:
        if _PLAIN_NUMBER.fullmatch(text):
            return Fraction(text)
        if match := _SLASH_FRACTION.fullmatch(text):
            return Fraction(match.group(1)) / Fraction(match.group(2))
        if match := _LATEX_FRACTION.fullmatch(text):
            value = Fraction(match.group(2)) / Fraction(match.group(3))
            return -value if match.group(1) == "-" else value
        if match := _MIXED_NUMBER.fullmatch(text):
            return _mixed_number(*match.groups())
    except (ValueError, ZeroDivisionError):  # over-long digit strings, zero denominators
        return None
    return None


def _mixed_number(sign: str, whole: str, numerator: str, denominator: str) -> Fraction | None:
    fraction = Fraction(int(numerator), int(denominator))
    if fraction >= 1:
        return None  # "2\frac{5}{3}" is a product, not a mixed number
    value = int(whole) + fraction
    return -value if sign == "-" else value


def numbers_equal(first: str, second: str) -> bool | None:
    """Whether two plain numbers are equal (see module doc); None unless both are numbers."""
    first_value, second_value = parse_number(first), parse_number(second)
    if first_value is None or second_value is None:
        return None
    if _DECIMAL_MARK.search(first) or _DECIMAL_MARK.search(second):
        return numbers_close(first_value, second_value)
    return first_value == second_value


def numbers_close(first: Fraction, second: Fraction) -> bool:
    """``math.isclose(first, second, rel_tol=REL_TOL, abs_tol=ABS_TOL)``, exactly."""
    # Exact Fraction arithmetic: floats would overflow on huge integers.
    scale = max(abs(first), abs(second))
    return abs(first - second) <= max(Fraction(REL_TOL) * scale, Fraction(ABS_TOL))


def has_zero_denominator(text: str) -> bool:
    """Whether a normalised answer divides by a literal zero (``\\frac{x}{0}``, ``1/0.0``)."""
    if _SLASH_ZERO.search(text):
        return True
    for match in _FRAC.finditer(text):
        numerator = read_argument(text, match.end())
        denominator = numerator and read_argument(text, numerator[1])
        if denominator and _ZERO.fullmatch(denominator[0]):
            return True
    return False
