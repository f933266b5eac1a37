"""Step kinds: flat groups, two-stage trees, parallel paths, each one module behind the
protocol of ``base.StepKind`` with its ledger record (``flat_record``, ``tree_record``,
``parallel_record``: registered in ``rlvr_fast.ledger.records`` on import, so importing this
package is what lets the ledger read their lines back). ``config.sampler`` names the kind of a
run."""

from __future__ import annotations

from rlvr_fast.train.kinds.base import Question, RecordInputs, StepKind
from rlvr_fast.train.kinds.flat import FlatKind
from rlvr_fast.train.kinds.parallel import ParallelKind
from rlvr_fast.train.kinds.tree import TreeKind

KINDS: dict[str, type] = {kind.name: kind for kind in (FlatKind, TreeKind, ParallelKind)}


def step_kind(sampler: str) -> type:
    """The kind class of ``sampler`` (an error listing the valid names otherwise)."""
    if sampler not in KINDS:
        raise ValueError(f"sampler must be one of {', '.join(KINDS)}, got {sampler!r}")
    return KINDS[sampler]


__all__ = ["KINDS", "FlatKind", "ParallelKind", "Question", "RecordInputs", "StepKind", "TreeKind"]
