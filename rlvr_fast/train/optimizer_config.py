"""The optimizer's hyperparameters: the learning rate, AdamW's betas, epsilon and weight decay
(Adafactor takes lr and weight_decay), and the gradient's clipping, a component of
``TrainConfig`` (``config.optim``); which optimizer steps them is ``optimizer``
(``rlvr_fast.train.stepping``), whose checks read them."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.utils.settings import setting


@dataclass
class OptimizerConfig:
    # Past 1e30 AdamW's first step size, lr / (1 - beta1), leaves float32 (a traceback in
    # torch's AdamW); a learning rate that large only tests the non-finite stop.
    lr: float = setting(
        1e-5, "AdamW learning rate", lambda v: 0 < v <= 1e30, "lr must be in (0, 1e30], got {value}"
    )
    betas: tuple[float, float] = setting(
        (0.9, 0.999),
        "AdamW betas",
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "betas must be two numbers in [0, 1), got {value}",
    )
    eps: float = setting(1e-8, "AdamW epsilon", lambda v: v > 0, "eps must be > 0, got {value}")
    weight_decay: float = setting(
        0.01,
        "AdamW decoupled weight decay",
        lambda v: v >= 0,
        "weight_decay must be >= 0, got {value}",
    )
    max_grad_norm: float | None = setting(
        1.0,
        "clip the gradient's total norm to this (None: no clipping; the norm is logged before)",
        lambda v: v is None or v > 0,
        "max_grad_norm must be > 0 or None, got {value}",
    )
