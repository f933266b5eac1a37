"""The ledger record of a two-stage tree step (``rlvr_fast.ledger.records``): K pairs of B = 2
leaves, leaf order k-major. Stage 1 samples K roots p^(k) from the prompt; |p^(k)|
(``stage1_lengths``) counts the tokens it sampled for root k, trimmed after EOS but including
the tail beyond the cut that is thrown away. Stage 2 samples the continuations of the
*continued* branches, those with generation left to do, fixed by the pair's category (the table
in ``rlvr_fast.rollouts.pairs``).

  gen        = sum_k |p^(k)| + stage2_gen: every token sampled, once; stage2_gen is what Stage 2
               sampled, sum over continued branches of (L_kb - pl_kb).
  pref       = K L_p + sum_cont (L_p + pl_kb): the seed's prefill, which prefills the prompt once
               per root and then re-prefills prompt + prefix for every continued branch.
  pad_pref   = K L_p + B_cont max_cont (L_p + pl_kb)     (B_cont continued branches; 0 if none)
  untrim_gen = K max_k |p^(k)| + B_cont max_cont (L_kb - pl_kb)
The seed's conservation identity S1_leaf + S2_leaf = leaf reads off the tuples, with
S1_leaf = sum pl_b and S2_leaf = sum (L_b - pl_b). S2_leaf is *not* stage2_gen: a branch kept
whole from Stage 1 (branch 0 of tau_zero, midpoint_fallback and early_eos_gt104 pairs) has
L_b - pl_b tokens in S2_leaf that were sampled in Stage 1 and are counted in gen through |p^(k)|.

Its laws beyond every question's (``TreeRecord.kind_laws``): tree categories only; pl0 = pl1;
the per-category layout of the table (terminal_dup: l0 = l1 = pl >= 1 and r0 = r1, one
sequence graded twice; tau_zero: pl = 0; midpoint pairs: 1 <= pl < l0; early_eos_gt104:
l0 > 104); the Stage-1 origin of every inherited token (causal_non_eos: pl <= |p^(k)|, the
prefix was cut from the root; terminal_dup: |p^(k)| = pl; roots kept whole: |p^(k)| = l0);
1 <= |p^(k)| <= max_new_tokens; stage2_gen = sum_cont (L_kb - pl_kb); gen, pref, pad_pref and
untrim_gen by the formulas above."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.ledger.records import StepRecord, register_record
from rlvr_fast.rollouts.pairs import (
    EARLY_EOS_GT104_MIN_LENGTH,
    TREE_CATEGORIES,
    PairCategory,
    TreePair,
)


@register_record
@dataclass(kw_only=True)
class TreeRecord(StepRecord):
    """A tree step's line: |p^(k)| per root and the tokens Stage 2 sampled."""

    stage1_lengths: list[int]
    stage2_gen: int

    def kind_laws(self, require, engine_counts: bool) -> None:
        cap = self.max_new_tokens
        require(len(self.stage1_lengths) == len(self.pairs) >= 1, "one Stage-1 root per pair")
        require(all(p[6] in TREE_CATEGORIES for p in self.pairs), "tree categories only")
        for (pl0, pl1, l0, l1, r0, r1, category), root in zip(self.pairs, self.stage1_lengths):
            require(pl0 == pl1, "both branches of a pair share one prefix")
            require(1 <= root <= cap, "1 <= |p^(k)| <= max_new_tokens")
            if category == PairCategory.CAUSAL_NON_EOS:
                require(1 <= pl0 <= root, "causal_non_eos: 1 <= tau_k <= |p^(k)|")
            elif category == PairCategory.TERMINAL_DUP:
                require(1 <= pl0 == l0 == l1 == root, "terminal_dup: pl = L = |p^(k)| >= 1")
                require(r0 == r1, "terminal_dup: one sequence, one reward")
            elif category == PairCategory.TAU_ZERO:
                require(pl0 == 0, "tau_zero: pl = 0")
            else:
                require(1 <= pl0 < l0, f"{category}: 1 <= pl < l0")
            if PairCategory(category).root_kept_whole:
                require(l0 == root, f"{category}: branch 0 is the Stage-1 root, l0 = |p^(k)|")
            if category == PairCategory.EARLY_EOS_GT104:
                require(l0 >= EARLY_EOS_GT104_MIN_LENGTH, "early_eos_gt104: l0 > 104")
        sampled = sum(length - pl for pl, length in continued_branches(self.pairs))
        require(self.stage2_gen == sampled, "stage2_gen = sum over continued branches of L - pl")
        gen, pref, pad_pref, untrim_gen = tree_token_counts(
            self.pairs, self.stage1_lengths, self.stage2_gen, self.prompt_len
        )
        require(self.gen == gen, "gen = sum |p^(k)| + stage2_gen")
        require(self.pref == pref, "pref = K L_p + sum_cont (L_p + pl)")
        require(self.pad_pref == pad_pref, "pad_pref = K L_p + B_cont max_cont (L_p + pl)")
        require(
            self.untrim_gen == untrim_gen, "untrim_gen = K max |p^(k)| + B_cont max_cont (L - pl)"
        )


def tree_step_record(
    *,
    step: int,
    question_id: str,
    rewards: list[float],
    sigma_r: float,
    active: bool,
    optimizer_step: bool,
    prompt_len: int,
    pairs: Sequence[TreePair],
    stage2_gen: int,
    executed: EngineCounters,
    max_new_tokens: int,
    params: int,
    loss: float | None,
    grad_norm: float | None,
    seconds: dict[str, float],
) -> TreeRecord:
    """The ledger line of a two-stage K x 2 tree step; rewards are per leaf, k-major (leaf 2k + b).
    stage2_gen is the number of tokens Stage 2 sampled, as the sampler counted it."""
    if not pairs:
        raise ValueError("a tree step needs at least one pair")
    if len(rewards) != 2 * len(pairs):
        raise ValueError(f"need one reward per leaf ({2 * len(pairs)}), got {len(rewards)}")
    for pair in pairs:
        if pair.category not in TREE_CATEGORIES:
            raise ValueError(
                f"unknown tree category {str(pair.category)!r} "
                f"(valid: {', '.join(map(str, TREE_CATEGORIES))})"
            )
        if len(pair.leaves) != 2:
            raise ValueError(f"a pair has 2 leaves, got lengths {pair.lengths}")
    tuples = [
        [
            p.prefix_len,
            p.prefix_len,
            p.lengths[0],
            p.lengths[1],
            rewards[2 * k],
            rewards[2 * k + 1],
            PairCategory(p.category).value,
        ]
        for k, p in enumerate(pairs)
    ]
    lengths = [n for p in pairs for n in p.lengths]
    stage1_lengths = [p.stage1_len for p in pairs]
    leaf = sum(lengths)
    gen, pref, pad_pref, untrim_gen = tree_token_counts(
        tuples, stage1_lengths, stage2_gen, prompt_len
    )
    return TreeRecord(
        step=step,
        question_id=question_id,
        rewards=rewards,
        sigma_r=sigma_r,
        homogeneous=sigma_r == 0,
        active=active,
        optimizer_step=optimizer_step,
        pairs=tuples,
        prompt_len=prompt_len,
        lengths=lengths,
        gen=gen,
        pref=pref,
        pad_pref=pad_pref,
        untrim_gen=untrim_gen,
        leaf=leaf,
        bwd_out=leaf if active else 0,
        bwd_full=len(lengths) * prompt_len + leaf if active else 0,
        max_new_tokens=max_new_tokens,
        params=params,
        loss=loss,
        grad_norm=grad_norm,
        seconds=seconds,
        stage1_lengths=stage1_lengths,
        stage2_gen=stage2_gen,
        **executed.to_json(),
    )


def continued_branches(pairs: list[list]) -> list[tuple[int, int]]:
    """(pl, L) of every branch Stage 2 continued, read off the tuples' categories."""
    return [
        (pair[b], pair[2 + b])
        for pair in pairs
        for b in (0, 1)
        if pair[6] in TREE_CATEGORIES and PairCategory(pair[6]).continues(b)
    ]


def tree_token_counts(
    pairs: list[list], stage1_lengths: list[int], stage2_gen: int, prompt_len: int
) -> tuple[int, int, int, int]:
    """(gen, pref, pad_pref, untrim_gen) of a tree step by the module's formulas."""
    roots = len(pairs)
    continued = continued_branches(pairs)
    gen = sum(stage1_lengths) + stage2_gen
    pref = roots * prompt_len + sum(prompt_len + pl for pl, _ in continued)
    pad_pref = roots * prompt_len + len(continued) * max(
        (prompt_len + pl for pl, _ in continued), default=0
    )
    untrim_gen = roots * max(stage1_lengths) + len(continued) * max(
        (length - pl for pl, length in continued), default=0
    )
    return gen, pref, pad_pref, untrim_gen
