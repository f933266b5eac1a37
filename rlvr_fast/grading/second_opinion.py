"""math-verify as the second opinion (runs inside the grading worker, under its deadline).

The extracted answers are handed to math-verify boxed, gold first (its ``verify`` is not
symmetric).  math-verify's own ``signal.alarm`` timeouts are switched off: the worker's
deadline covers our pipeline and math-verify together.  Any math-verify failure is "no".
"""

from __future__ import annotations

import logging


def quiet_math_verify() -> None:
    """Silence math-verify's per-process warning that its own timeouts are off (ours are on)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify's verdict on an extracted answer against the gold answer."""
    from math_verify import parse, verify

    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
        pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # a second opinion must never break grading
        return False
