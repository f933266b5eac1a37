"""``EngineCounters``: the work the rollout engine executed, one name per figure from the engine
to the ledger (``prefill_run``, ``decode_rows``, ``block_copies``, ``peak_kv_blocks``,
``preemptions``).

These are what ran, not the seed's accounting: a GRPO group that prefills its prompt once and
forks it G times has ``prefill_run`` = |prompt| where the seed's ``pref`` is G |prompt|.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


# The counts that add up over steps (``peak_kv_blocks`` is a maximum).
SUMMED_COUNTERS = ("prefill_run", "decode_rows", "block_copies", "preemptions")


@dataclass
class EngineCounters:
    """prefill_run: tokens run through multi-token (prefill) passes; decode_rows: rows run
    through one-token (decode) passes; block_copies: copy-on-write block copies; peak_kv_blocks:
    the most KV blocks in use at once; preemptions: sequences sent back to wait (and recomputed)
    because the cache was full."""

    prefill_run: int = 0
    decode_rows: int = 0
    block_copies: int = 0
    peak_kv_blocks: int = 0
    preemptions: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)
