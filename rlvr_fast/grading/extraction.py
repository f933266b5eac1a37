"""Finding the answer in a response: the last ``\\boxed{}`` / ``\\fbox{}`` and the seed's gate.

* ``extract_boxed`` -- the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (whichever
  starts last), braces matched with nesting, surrounding whitespace stripped; the LaTeX
  shorthand ``\\boxed 5`` (a space, then a token up to whitespace or ``$``) is accepted too.
  None when there is no box, the last box's braces never close, or (with ``max_chars``) they
  do not close within that many characters, so a huge box is never scanned to its end.
* ``passes_gate`` -- the seed's length gate, exactly ``text.rfind("\\boxed") >= min_chars``.
* ``final_answer`` -- what a response answers for grading: the gate (when asked for), then
  the last box read under the grading size cap.
"""

from __future__ import annotations

import re

from rlvr_fast.grading.tex import read_braced

BOX_COMMANDS = ("\\boxed", "\\fbox")
# Longer answers are garbage for grading purposes; the cap also bounds the time spent
# scanning and normalising in the caller, which no worker deadline covers.
MAX_ANSWER_CHARS = 1000

_SPACES = re.compile(r" +")
_SHORTHAND_TOKEN = re.compile(r"[^\s$]+")


def extract_boxed(text: str, *, max_chars: int | None = None) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text``, or None (module doc)."""
    start, command = max((text.rfind(command), command) for command in BOX_COMMANDS)
    if start < 0:
        return None
    return _read_box_argument(text, start + len(command), max_chars)


def _read_box_argument(text: str, pos: int, max_chars: int | None) -> str | None:
    after_spaces = _SPACES.match(text, pos)
    arg_pos = after_spaces.end() if after_spaces else pos
    if text.startswith("{", arg_pos):
        end = None if max_chars is None else arg_pos + max_chars + 2
        group = read_braced(text, arg_pos, end)
        return None if group is None else group[0].strip()
    if after_spaces is None:
        return None  # e.g. "\boxedx" or "\boxed" at the very end: not a box
    token = _SHORTHAND_TOKEN.match(text, arg_pos)
    if token is None or (max_chars is not None and len(token.group(0)) > max_chars):
        return None
    return token.group(0)


def passes_gate(text: str, min_chars: int = 30) -> bool:
    """The seed's gate: the last ``\\boxed`` starts at index ``min_chars`` or later."""
    return text.rfind("\\boxed") >= min_chars


def final_answer(text: str, *, min_chars: int | None = None) -> str | None:
    """The last boxed answer of a response, read under ``MAX_ANSWER_CHARS``; None when the
    response has none, its box is longer than the cap, or it fails the gate (``min_chars``)."""
    if min_chars is not None and not passes_gate(text, min_chars):
        return None
    return extract_boxed(text, max_chars=MAX_ANSWER_CHARS)
