"""The settings of two-stage tree rollouts with TreeRL credit (``rlvr_fast.rollouts.trees``,
``rlvr_fast.credit.tree``), a component of ``TrainConfig`` (``config.tree``); the tree kind
checks them across fields (``rlvr_fast.train.kinds.tree``)."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.rollouts.limits import MAX_GROUP_SIZE
from rlvr_fast.rollouts.trees import EARLY_EOS_MODES
from rlvr_fast.utils.settings import must_be_one_of, one_of, setting


@dataclass
class TreeConfig:
    early_eos_mode: str = setting(
        "terminal_dup",
        "tree branching rule for a root that ends early (the seed's --early-eos-mode)",
        one_of(EARLY_EOS_MODES),
        must_be_one_of("early_eos_mode", EARLY_EOS_MODES),
    )
    tree_k: int = setting(
        4,
        "roots per tree (K)",
        lambda v: 1 <= v <= MAX_GROUP_SIZE // 2,
        f"tree_k must be in [1, {MAX_GROUP_SIZE // 2}], got {{value}}",
    )
    tree_b: int = setting(
        2,
        "branches per root (B)",
        lambda v: v == 2,
        "tree_b must be 2 (the ledger records pairs), got {value}",
    )
    t_min: int = setting(96, "Stage 1 stops at the first newline at or after this token")
    t_max: int = setting(160, "Stage 1's cap")
    beta: float = setting(
        0.0,
        "sibling-disagreement prefix bonus of TreeRL credit",
        lambda v: 0 <= v <= 1,
        "beta must be in [0, 1], got {value}",
    )
    alpha: float = setting(
        0.5,
        "continuation credit's mix of leaf and sibling advantage",
        lambda v: 0 <= v <= 1,
        "alpha must be in [0, 1], got {value}",
    )
    clamped_prefix: bool = setting(False, "one-sided clamped prefix credit (Proposition 3)")
    bifurcate_after_active: int = setting(
        0,
        "tree arms sample flat groups until this many steps ran a backward pass",
        lambda v: v >= 0,
        "bifurcate_after_active must be >= 0",
    )
    tree_reprefill: bool = setting(
        False, "re-prefill each Stage-2 branch instead of forking it (the seed's cost, measured)"
    )
