"""TeX scanning shared by box extraction, normalisation and the sympy converter: braced groups,
macro arguments and control words."""

from __future__ import annotations

import re

CONTROL_WORD = re.compile(r"\\(?:[a-zA-Z]+|.)")


def read_braced(text: str, open_pos: int, end: int | None = None) -> tuple[str, int] | None:
    """(content, index after the closing brace) of the group opening at ``open_pos``.

    None when the group does not close before ``end`` (default: the end of ``text``).
    Escaped characters (``\\{``, ``\\}``, ``\\\\``) never open or close a group.
    """
    stop = len(text) if end is None else min(end, len(text))
    depth = 0
    pos = open_pos
    while pos < stop:
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : pos], pos + 1
        pos += 1
    return None


def read_argument(text: str, pos: int) -> tuple[str, int] | None:
    """One TeX macro argument at ``pos``: a braced group, a control word or one character."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        return read_braced(text, pos)
    if text[pos] == "\\":
        word = CONTROL_WORD.match(text, pos)
        return (word.group(0), word.end()) if word else None
    return text[pos], pos + 1
