"""The dynamic loss scale of ``fp16-mixed`` (``rlvr_fast.train.precision``), with
``torch.amp.GradScaler``'s semantics and defaults: the loss is multiplied by the scale (2^16 at
the start) before backward, so that small fp16 gradients do not flush to zero; the float32
master gradients are divided by it before the all-reduce's norm, clipping and step. A step
whose gradients hold an infinity or a NaN (the scaled fp16 backward overflowed) takes no
optimizer step and halves the scale; after 2,000 clean steps in a row the scale doubles (unless
that would overflow float32). A zero-gradient step (``rlvr_fast.train.decision``: no backward)
is a clean step, as TRL's backward of a zero loss through the GradScaler is. The scale stays a
power of two, so scaling and unscaling are exact. Sharded (``rlvr_fast.train.sharding``), each
rank unscales and checks its own shards of the gradients, and the ranks' findings are
all-reduced: an overflow in one rank's shard skips the step on every rank, and every rank's
scale stays the same.
"""

from __future__ import annotations

import math

import torch

from rlvr_fast.train import distributed

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScaler:
    """The scale and the count of clean steps since it last changed (GradScaler's growth
    tracker); a checkpointed component. ``growth_interval`` other than 2,000 is for tests."""

    def __init__(self, growth_interval: int = GROWTH_INTERVAL) -> None:
        self.scale = INIT_SCALE
        self.growth_tracker = 0
        self.growth_interval = growth_interval

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide ``params``' gradients by the scale; whether every one is finite (sharded:
        every rank's shards, agreed over the ranks, a collective)."""
        params = list(params)
        sharded = any(hasattr(p, "to_local") for p in params)
        grads = [p.grad.to_local() if sharded else p.grad for p in params if p.grad is not None]
        finite = True
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            finite = bool(torch.stack([g.isfinite().all() for g in grads]).all())
        if sharded:
            finite = distributed.max_over_ranks(int(not finite)) == 0
        return finite

    def update(self, finite: bool) -> None:
        """After a step: back off on an overflow, grow after GROWTH_INTERVAL clean steps."""
        if not finite:
            self.scale *= BACKOFF_FACTOR
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * GROWTH_FACTOR
            if math.isfinite(float(torch.tensor(grown, dtype=torch.float32))):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def check_state(self, state: dict) -> None:
        scale, tracker = state.get("scale"), state.get("growth_tracker")
        if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale {scale!r} is not a positive number")
        if isinstance(tracker, bool) or not isinstance(tracker, int) or not 0 <= tracker:
            raise ValueError(f"loss-scale growth tracker {tracker!r} is not a count")

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = state["scale"], state["growth_tracker"]
