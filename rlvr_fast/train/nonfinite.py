"""The run stops at the first step whose loss, gradient norm or weights are not finite, before
it is checkpointed: the last checkpoint stays the last good state."""

from __future__ import annotations

import math
from pathlib import Path

import torch


class NonFiniteError(ValueError):
    """Training produced a non-finite loss, gradient norm or weight."""


def check_finite(
    step: int, record: dict, model: torch.nn.Module, lr: float, checkpoint: Path | None
) -> None:
    """Raise ``NonFiniteError`` naming what is not finite in step ``step``'s ledger ``record``
    or in ``model``'s trainable weights, and where the last good state is."""
    bad = [
        f"{name} {record[name]}"
        for name in ("loss", "grad_norm")
        if record.get(name) is not None and not math.isfinite(record[name])
    ]
    params = [p for p in model.parameters() if p.requires_grad]
    finite = torch.stack([p.detach().isfinite().all() for p in params]).all()
    if not bad and bool(finite):
        return
    if not bool(finite):
        bad.append(
            "weight "
            + next(name for name, p in model.named_parameters() if not p.detach().isfinite().all())
        )
    kept = (
        ""
        if checkpoint is None
        else (
            f"; {checkpoint} keeps the last good state"
            if checkpoint.exists()
            else "; no checkpoint was written yet"
        )
    )
    raise NonFiniteError(
        f"step {step}: non-finite {', '.join(bad)} (lr {lr:g}){kept}; "
        "--set allow_nonfinite=true trains on"
    )
