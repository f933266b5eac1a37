"""Normalisation: one canonical spelling of an answer, applied to both sides before comparing.

In order: digits of any script and full-width ASCII forms -> ASCII (a number is the same
number in any script: ``５``, ``٥`` and ``५`` all read as ``5``); surrounding/escaped ``$``;
``,\\!`` between digit groups -> ``,``; ``\\left``/``\\right``/``\\big``-style sizing and
``\\displaystyle``; the spacing commands ``\\!``, ``\\,``, ``\\;``, ``\\:``, ``\\ ``, ``\\quad``,
``~``; a trailing period; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\inf``, ``∞``, ``π``, unicode
minus, ``\\varnothing``; ``bmatrix`` -> ``pmatrix``; degrees (``^\\circ``, ``^{\\circ}``, ``°``,
``\\degree``); percent signs (``50\\%`` equals ``50``, the MATH convention, and NOT ``0.5``);
units in a trailing ``\\text{...}``/``\\mbox{...}`` (``5 \\text{ cm}``); other ``\\text``/
``\\textbf``/``\\mathrm``-style wrappers are unwrapped (``\\text{(A)}`` -> ``(A)``); the words
``and``/``or`` between answers and ``;`` become ``,`` (``6 \\text{ and } 8`` -> ``6,8``); a
label in front of a single answer (``x =``, ``AB=``, ``f(x) =``, ``(p,q)=``, ``S:T=``,
``x \\in``; answers with several labels keep them for the item-by-item comparison); units as
trailing words after a number (``10 dollars``); thousands separators when the whole answer is
one digit-grouped number (``1,000,000``, ``11,\\! 111,\\! 100``; ``(2,12)\\cup(12,102)`` keeps
its commas); whitespace; ``\\frac12``/``\\frac1{2}``/``\\sqrt2`` shorthand -> braced
arguments; ``.5`` -> ``0.5``.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from rlvr_fast.grading.tex import read_argument, read_braced

_FULL_WIDTH_FIRST, _FULL_WIDTH_LAST, _FULL_WIDTH_OFFSET = 0xFF01, 0xFF5E, 0xFEE0
_IDEOGRAPHIC_SPACE = 0x3000


class _AsciiForms(dict):
    """``str.translate`` table, filled on demand: a decimal digit of any script -> its ASCII
    digit, a full-width ASCII form -> the ASCII character, anything else unchanged."""

    def __missing__(self, code_point: int) -> str | int:
        char = chr(code_point)
        if _FULL_WIDTH_FIRST <= code_point <= _FULL_WIDTH_LAST:
            value: str | int = chr(code_point - _FULL_WIDTH_OFFSET)
        elif code_point == _IDEOGRAPHIC_SPACE:
            value = " "
        elif (digit := unicodedata.decimal(char, None)) is not None:
            value = str(digit)
        else:
            value = code_point
        self[code_point] = value
        return value


_ASCII_FORMS = _AsciiForms()
# A name that labels an answer: x, AB, x_1, x_{10}, \theta, f(x), f'.
_NAME = r"(?:[A-Za-z]{1,3}|\\[a-zA-Z]+)(?:_\{?\w+\}?|')?(?:\([A-Za-z]\))?"
LABEL = re.compile(
    rf"(?P<label>{_NAME}(?:\s*:\s*{_NAME})*|\(\s*{_NAME}(?:\s*,\s*{_NAME})+\s*\))"
    r"\s*(?:=(?!=)|\\in(?![a-zA-Z]))\s*",
    re.ASCII,
)
_THIN_SPACED_GROUP = re.compile(r"(?<=\d),\\!\s*(?=\d{3}(?!\d))", re.ASCII)
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
# "and"/"or" between two answers: after a digit or a closing bracket, so "a and b" stays text.
_WORD_SEPARATOR = re.compile(r"(?<=[\d)\]}])\s*(?<![A-Za-z])(?:and|or)(?![A-Za-z])\s*(?=\S)")
_WORD_UNITS = re.compile(r"(?<=[\d}])\s+[A-Za-z]{2,}[A-Za-z.]*(?:\s+[A-Za-z.]+)*$")
_GROUPED_NUMBER = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
# Whitespace is dropped, except one space that ends a control word before a letter
# ("\pi r" must not become "\pir").
_WHITESPACE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])|\s+")
_FRAC_OR_SQRT = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
_BARE_DECIMAL_POINT = re.compile(r"(?<!\d)\.(?=\d)")


@functools.lru_cache(maxsize=8192)
def normalize(answer: str) -> str:
    """The canonical spelling of ``answer`` (cached: golds repeat across a group)."""
    text = answer.strip()
    for step in _NORMALIZATION_STEPS:
        text = step(text)
    return text


def split_label(text: str) -> tuple[str, str]:
    """(label, value) of ``label = value``; ("", text) when ``text`` has no label."""
    match = LABEL.match(text)
    if match is None or match.end() == len(text):
        return "", text
    return re.sub(r"\s+", "", match.group("label")), text[match.end() :]


def _to_ascii_forms(text: str) -> str:
    return text if text.isascii() else text.translate(_ASCII_FORMS)


def _remove_dollars(text: str) -> str:
    return text.replace("\\$", "").replace("$", "")


def _join_thin_spaced_groups(text: str) -> str:
    return _THIN_SPACED_GROUP.sub(",", text)


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
        group = read_braced(text, match.end())
        if group is None:
            return text
        content, end = group
        text = text[: match.start()] + content + text[end:]
    return text


def _separate_answers(text: str) -> str:
    return _WORD_SEPARATOR.sub(",", text).replace(";", ",")


def _remove_single_label(text: str) -> str:
    label, value = split_label(text)
    # Several labels ("a = 3, b = -1") are kept: the item-by-item comparison reads them.
    return value if label and not LABEL.search(value) else text


def _remove_word_units(text: str) -> str:
    return _WORD_UNITS.sub("", text)


def _remove_thousands_separators(text: str) -> str:
    return text.replace(",", "") if _GROUPED_NUMBER.fullmatch(text) else text


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
            argument = read_argument(text, pos)
            if argument is None:
                break
            content, pos = argument
            parts.append("{" + _expand_shorthand_arguments(content) + "}")
    parts.append(text[pos:])
    return "".join(parts)


def _add_leading_zero(text: str) -> str:
    return _BARE_DECIMAL_POINT.sub("0.", text)


_NORMALIZATION_STEPS = (
    _to_ascii_forms,
    _remove_dollars,
    # before "\!" goes, so that "11,\! 111" stays one number
    _join_thin_spaced_groups,
    _remove_sizing_and_spacing,
    _remove_trailing_period,
    _unify_spellings,
    _remove_degrees_and_percent,
    _remove_text_unit,
    _unwrap_text_commands,
    _separate_answers,
    _remove_single_label,
    _remove_word_units,
    # before whitespace goes, so that "1, 234" stays a pair
    _remove_thousands_separators,
    _collapse_whitespace,
    _expand_shorthand_arguments,
    _add_leading_zero,
)
