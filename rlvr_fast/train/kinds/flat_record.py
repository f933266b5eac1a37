"""The ledger record of a flat step (``rlvr_fast.ledger.records``): G rollouts, pairs (2i, 2i+1)
with prefix lengths 0, category "flat" on flat arms and "flat_warmup" on a tree arm's steps
before bifurcation starts. gen = leaf (trimmed after the first EOS, EOS included);
pref = pad_pref = G L_p (one prompt, so no padding); untrim_gen = G max L_i (what a sampler that
keeps every row until the last one ends would decode). A step ``reused`` (an update of
num_iterations on an earlier step's rollouts, or a later step of a generation of
generation_steps > 1) samples nothing: gen = pref = pad_pref = untrim_gen = decode_rows = 0.

Its laws beyond every question's (``FlatRecord.kind_laws``): one flat category, pl = 0, no
Stage 2, the counts above, and decode_rows = sum (L_i - 1) unless the engine preempted (the
first token of a row comes from its prompt's logits; no decode after EOS)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.ledger.records import StepRecord, register_record
from rlvr_fast.rollouts.pairs import PairCategory


@register_record
@dataclass(kw_only=True)
class FlatRecord(StepRecord):
    """A flat step's line: no fields beyond every question's."""

    def expected_decode_rows(self) -> int:
        return 0 if self.reused else sum(n - 1 for n in self.lengths)

    def kind_laws(self, require, engine_counts: bool) -> None:
        group = len(self.lengths)
        categories = {p[6] for p in self.pairs}
        require(
            len(categories) == 1 and PairCategory(categories.pop()).is_flat,
            "a flat step has one flat category",
        )
        require(all(p[0] == p[1] == 0 for p in self.pairs), "flat steps: pl = 0")
        if self.reused:
            require(
                self.gen == self.pref == self.pad_pref == self.untrim_gen == 0,
                "a reused step samples nothing: gen = pref = pad_pref = untrim_gen = 0",
            )
            require(not engine_counts or self.decode_rows == 0, "a reused step decodes nothing")
            return
        require(self.gen == self.leaf, "flat steps: gen = leaf")
        require(
            self.pref == self.pad_pref == group * self.prompt_len,
            "flat steps: pref = pad_pref = G L_p",
        )
        require(self.untrim_gen == group * max(self.lengths), "untrim_gen = G max L_i")
        require(
            not engine_counts
            or self.preemptions > 0
            or self.decode_rows == self.expected_decode_rows(),
            "decode work = sum(L_i - 1): no decode after EOS",
        )


def flat_step_record(
    *,
    step: int,
    question_id: str,
    rewards: list[float | None],
    sigma_r: float,
    active: bool,
    optimizer_step: bool,
    prompt_len: int,
    lengths: list[int],
    executed: EngineCounters,
    max_new_tokens: int,
    params: int,
    loss: float | None,
    grad_norm: float | None,
    seconds: dict[str, float],
    category: PairCategory = PairCategory.FLAT,
    reused: bool = False,
    trained: list[int] | None = None,
) -> FlatRecord:
    """A flat step's line; ``reused``: an update on an earlier step's rollouts
    (``num_iterations``, ``generation_steps``), which sampled nothing (gen, pref, pad_pref and
    untrim_gen 0); ``trained``: the completions the step's backward ran on (None: all)."""
    category = PairCategory(category)
    if not category.is_flat:
        raise ValueError(f"a flat step's category must be flat or flat_warmup, got {category}")
    # A completion no reward function scored (NaN, rlvr_fast.trl_compat) is recorded as null.
    rewards = [None if r is None or math.isnan(r) else r for r in rewards]
    group = len(lengths)
    leaf = sum(lengths)
    backward = [lengths[i] for i in trained] if trained is not None else lengths
    pairs = [
        [0, 0, lengths[i], lengths[i + 1], rewards[i], rewards[i + 1], category.value]
        for i in range(0, group - 1, 2)
    ]
    return FlatRecord(
        step=step,
        question_id=question_id,
        rewards=rewards,
        sigma_r=sigma_r,
        homogeneous=sigma_r == 0,
        active=active,
        optimizer_step=optimizer_step,
        pairs=pairs,
        prompt_len=prompt_len,
        lengths=lengths,
        gen=0 if reused else leaf,
        pref=0 if reused else group * prompt_len,
        pad_pref=0 if reused else group * prompt_len,
        untrim_gen=0 if reused else group * max(lengths),
        leaf=leaf,
        reused=reused,
        trained=trained,
        bwd_out=sum(backward) if active else 0,
        bwd_full=len(backward) * prompt_len + sum(backward) if active else 0,
        max_new_tokens=max_new_tokens,
        params=params,
        loss=loss,
        grad_norm=grad_norm,
        seconds=seconds,
        **executed.to_json(),
    )
