"""The run stops at the first step whose loss, gradient norm or weights are not finite, before
it is checkpointed: the last checkpoint stays the last good state."""

from __future__ import annotations

import math
from pathlib import Path

import torch


class NonFiniteError(ValueError):
    """Training produced a non-finite loss, gradient norm or weight."""


def check_finite(
    step: int,
    record: dict,
    model: torch.nn.Module,
    lr: float,
    checkpoint: Path | None,
    allow: str = "--set allow_nonfinite=true",
) -> None:
    """Raise ``NonFiniteError`` naming what is not finite in step ``step``'s ledger ``record``
    or in ``model``'s trainable weights, where the last good state is, and the setting that
    trains on (``allow``, as the caller's interface spells it)."""
    bad = [
        f"{name} {record[name]}"
        for name in ("loss", "grad_norm")
        if record.get(name) is not None and not math.isfinite(record[name])
    ]
    weight = first_nonfinite_weight(model)
    if not bad and weight is None:
        return
    if weight is not None:
        bad.append(f"weight {weight}")
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
        f"step {step}: non-finite {', '.join(bad)} (lr {lr:g}){kept}; {allow} trains on"
    )


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """The name of the first trainable weight holding a NaN or an infinity, or None."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if bool(torch.stack([p.detach().isfinite().all() for _, p in params]).all()):
        return None
    return next(name for name, p in params if not p.detach().isfinite().all())
