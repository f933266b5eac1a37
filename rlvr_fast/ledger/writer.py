"""Appends checked lines to a run's ledger."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlvr_fast.ledger.laws import check_conservation
from rlvr_fast.ledger.records import LedgerRecord


class LedgerWriter:
    """Appends checked lines to ``ledger.jsonl``; each line is flushed and fsynced, so a kill
    leaves at most a partial last line, which a resume drops
    (``rlvr_fast.run.directory.whole_lines``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: LedgerRecord) -> None:
        check_conservation(record)
        self.file.write(json.dumps(record.to_json()) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()
