"""Structure of a normalised answer: scalars and the compounds that hold them.

Tuples and intervals keep their bracket pair (``(1, 2)`` is also the open interval, ``[0, 1)``
differs from ``(0, 1)``) and compare in order; sets ``\\{...\\}``, unions joined by ``\\cup`` and
bare comma lists (``1, 2``: a list of solutions) are unordered; ``pmatrix`` needs the same
shape.  Items of unordered answers may carry a label (``a=3, b=-1``), which the comparison
reads; a single parenthesised item is unwrapped (``(5)`` is ``5``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rlvr_fast.grading.normalisation import split_label

UNORDERED_KINDS = frozenset({"set", "union"})
_MATRIX = re.compile(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}")


@dataclass(frozen=True)
class Answer:
    """A normalised answer: a scalar, or a compound whose kind fixes how items compare."""

    kind: str  # "scalar", "set", "union", "matrix(rows...)" or a bracket pair like "[)"
    text: str = ""  # the scalar itself (kind == "scalar" only)
    items: tuple[Answer, ...] = ()
    label: str = ""  # "a" for the item "a=3" of a list; "" when unlabelled


def parse_answer(text: str) -> Answer:
    """The structure of a normalised answer (see the module doc)."""
    if (rows := _matrix_rows(text)) is not None:
        shape = tuple(len(row) for row in rows)
        return Answer(f"matrix{shape}", items=_parse_items(cell for row in rows for cell in row))
    if text.startswith("\\{") and text.endswith("\\}") and _closing_index(text, 1) == len(text) - 1:
        return Answer("set", items=_parse_labelled_items(split_top_level(text[2:-2], ",")))
    if len(union := split_top_level(text, "\\cup")) > 1:
        return Answer("union", items=_parse_items(union))
    if _is_bracketed(text):
        elements = split_top_level(text[1:-1], ",")
        if len(elements) > 1:
            return Answer(text[0] + text[-1], items=_parse_items(elements))
        if text[0] == "(" and text[-1] == ")":
            return parse_answer(text[1:-1])
    if len(elements := split_top_level(text, ",")) > 1:
        return Answer("set", items=_parse_labelled_items(elements))
    return Answer("scalar", text=text)


def _parse_items(texts: Iterable[str]) -> tuple[Answer, ...]:
    return tuple(parse_answer(text) for text in texts)


def _parse_labelled_items(texts: Iterable[str]) -> tuple[Answer, ...]:
    items = []
    for text in texts:
        label, value = split_label(text)
        answer = parse_answer(value)
        items.append(Answer(answer.kind, answer.text, answer.items, label))
    return tuple(items)


def _matrix_rows(text: str) -> list[list[str]] | None:
    match = _MATRIX.fullmatch(text)
    if match is None:
        return None
    rows = split_top_level(match.group(1), "\\\\")
    if rows and not rows[-1]:
        rows.pop()  # a trailing "\\" before \end ends the last row, it opens no new one
    return [split_top_level(row, "&") for row in rows]


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


def split_top_level(text: str, separator: str) -> list[str]:
    """``text`` split at each ``separator`` outside any bracket pair."""
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
