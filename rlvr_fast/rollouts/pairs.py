"""The pair categories of a step (seed §4.2, §5.1) and the record of one tree pair: one concept,
one module, read by the tree sampler (``rollout.py``), the trainer and the ledger.

A pair is a root and its B leaves. Flat steps pair rollouts (2i, 2i + 1) with no shared prefix.
Tree categories say which branches Stage 2 continues:

  category            prefix (pl)               branch 0                  branches 1 .. B-1
  causal_non_eos      tau_k >= 1 (newline cut)  continued from tau_k      continued from tau_k
  terminal_dup        T_EOS (root ended first)  the root, whole           the root, whole
  tau_zero            0 (root_resample)         the root, whole (T_EOS)   continued from the prompt
  midpoint_fallback   m, 1 <= m < T_EOS         the root, whole (T_EOS)   continued from m
  early_eos_gt104     m, 1 <= m < T_EOS         the root, whole (T_EOS)   continued from m

early_eos_gt104 is a midpoint-sampler pair whose root ended with EOS after more than 104 tokens;
the seed only counts these pairs, so they get the midpoint_fallback layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

EARLY_EOS_GT104_MIN_LENGTH = 105


class PairCategory(str, Enum):
    FLAT = "flat"
    FLAT_WARMUP = "flat_warmup"  # a tree arm's flat steps before bifurcation starts
    CAUSAL_NON_EOS = "causal_non_eos"
    TERMINAL_DUP = "terminal_dup"
    TAU_ZERO = "tau_zero"
    MIDPOINT_FALLBACK = "midpoint_fallback"
    EARLY_EOS_GT104 = "early_eos_gt104"

    def __str__(self) -> str:
        return self.value

    @property
    def is_flat(self) -> bool:
        return self in (PairCategory.FLAT, PairCategory.FLAT_WARMUP)

    @property
    def root_kept_whole(self) -> bool:
        """Branch 0 is the Stage-1 root, kept up to its EOS."""
        return self in (
            PairCategory.TAU_ZERO,
            PairCategory.MIDPOINT_FALLBACK,
            PairCategory.EARLY_EOS_GT104,
        )

    def continues(self, branch: int) -> bool:
        """Whether Stage 2 samples a continuation for ``branch`` of a tree pair."""
        if self is PairCategory.CAUSAL_NON_EOS:
            return True
        return self.root_kept_whole and branch > 0


FLAT_CATEGORIES = tuple(c for c in PairCategory if c.is_flat)
TREE_CATEGORIES = tuple(c for c in PairCategory if not c.is_flat)


@dataclass
class TreePair:
    """One root and its B leaves. ``prefix_len`` is tau_k, the tokens all leaves share (0 for a
    pair restarted at the root); ``root_tokens`` is what Stage 1 sampled for this root (trimmed
    after EOS, a cut root's discarded tail included)."""

    category: PairCategory
    prefix_len: int
    root_tokens: list[int]
    leaves: list[list[int]]
    finish_reasons: list[str]

    @property
    def lengths(self) -> list[int]:
        return [len(leaf) for leaf in self.leaves]

    @property
    def stage1_len(self) -> int:
        """|p^(k)|, the tokens Stage 1 sampled for this root."""
        return len(self.root_tokens)

    @property
    def continued(self) -> list[bool]:
        return [self.category.continues(b) for b in range(len(self.leaves))]
