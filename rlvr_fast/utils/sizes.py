"""Sizes in bytes as people write them: '24GiB', '141GB', '80 GiB', '1e9'."""

from __future__ import annotations

import math
import re

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


# 16 EiB: past any device; a float beyond it (1e400, 401 digits) would overflow an int.
MAX_SIZE = float(1 << 64)


def parse_size(text: str) -> int:
    """'24GiB', '141GB', '80 GiB', '1e9' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text, re.I)
    unit = match and (match.group(2).upper() or "B")
    if not match or unit not in UNITS:
        raise ValueError(
            f"a size is a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {text!r}"
        )
    size = float(match.group(1)) * UNITS[unit]
    if not math.isfinite(size) or size > MAX_SIZE:
        raise ValueError(f"a size is at most 16 EiB (2^64 bytes), got {text.strip()!r}")
    return int(size)
