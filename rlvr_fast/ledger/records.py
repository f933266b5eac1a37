"""The per-step ledger (seed §5.1): token counts, FLOPs and timings, one JSON line per step.

Every step stores per-pair tuples [pl0, pl1, l0, l1, r0, r1, category]: prefix length, leaf
length and reward of branches 0 and 1 of the pair. FLOPs at P trainable parameters:
Out = (2 gen + 6 bwd_out) P, Full = (2 (pref + gen) + 6 bwd_full) P,
PadFull = (2 (pad_pref + untrim_gen) + 6 bwd_full) P. On every step, with leaves of lengths L and
a prompt of L_p tokens: leaf = sum L; bwd_out = leaf and bwd_full = (number of leaves) L_p + leaf
on steps that run a backward pass, else 0.

Flat steps (``flat_step_record``): G rollouts, pairs (2i, 2i+1) with prefix lengths 0, category
"flat" on flat arms and "flat_warmup" on a tree arm's steps before bifurcation starts.
gen = leaf (trimmed after the first EOS, EOS included); pref = pad_pref = G L_p (one prompt, so
no padding); untrim_gen = G max L_i (what a sampler that keeps every row until the last one ends
would decode).

Tree steps (``tree_step_record``): K pairs of B = 2 leaves, leaf order k-major. Stage 1 samples
K roots p^(k) from the prompt; |p^(k)| (``stage1_lengths``) counts the tokens it sampled for root
k, trimmed after EOS but including the tail beyond the cut that is thrown away. Stage 2 samples
the continuations of the *continued* branches, those with generation left to do, fixed by the
pair's category (the table in ``rlvr_fast.rollouts.pairs``).

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

Alongside the seed's formulas every record keeps what our engine executed, under the engine's
own names (``rlvr_fast.engine.EngineCounters``, reported, not derived): ``prefill_run`` (prefill
tokens actually run: |prompt| for a group that prefills its prompt once and forks it, no Stage-2
prefill at all for forked trees), ``decode_rows`` (rows x decode steps), ``block_copies``,
``peak_kv_blocks`` and ``preemptions``.

Parallel-path steps (``parallel_step_record``, the Parallel-Shapley arms): R responses of K paths,
all forked from the prompt, recorded like a flat step over the R K paths (category "flat",
``rewards`` the paths' returns of ``rlvr_fast.credit.paths``), with a ``parallel`` section
(``ParallelStats``): phi, its standard error, U(N), U(∅), r_out, the utility calls and, under
the summary aggregator, each summary's prompt length (prompt + serialised paths) and length.
Summaries add to the counts: gen = leaf + sum L_s; pref = R K L_p + sum L_sp;
pad_pref = R K L_p + R_s max L_sp; untrim_gen = R K max L_i + R_s max L_s; bwd_out = leaf + sum L_s
and bwd_full = R K L_p + leaf + sum (L_sp + L_s) on backward steps; decode_rows =
sum (L_i - 1) + sum (L_s - 1) and prefill_run = L_p + sum (L_sp - L_p) (one prompt prefill, each
summary runs only its serialised paths) unless the engine preempted.

Multi-question steps (``multi_question_step_record``, ``questions_per_step`` Q > 1): one line per
optimizer step (``MultiQuestionRecord``) holding one sub-record per question (``questions``, each
a flat or tree ``StepRecord`` of that question, its ``loss`` the question's loss and its
``grad_norm`` the norm of its gradient before unit scaling) and the step's totals: gen, pref,
pad_pref, untrim_gen, leaf, bwd_out and bwd_full are the sums over its questions,
``zero_var_questions`` counts the homogeneous ones, ``loss`` is the unit-normalised surrogate
(1/n) sum_q L_q / |g_q| over the n questions that contributed and ``grad_norm`` the norm of
their averaged unit gradients before clipping. The Q questions are sampled in one batch, so the
engine's counts are the step's and a sub-record's are 0. A data-parallel step
(``rlvr_fast.train.distributed``) is the same line with the questions of every rank in step order; its
engine counts are the ranks' summed (``peak_kv_blocks`` the sum of each rank's peak) and its
timings rank 0's, with an ``all_reduce`` phase on active steps.

``check_conservation`` enforces the laws every line must satisfy; a violation is a bug in the
trainer or the sampler, so writing raises instead of recording a wrong line. Laws on every step:
one reward and one length per leaf, the tuples list exactly them; S1_leaf + S2_leaf = leaf;
0 <= L_b - pl_b <= max_new_tokens - pl_b; bwd_out and bwd_full as above; homogeneous iff all
rewards agree. Flat steps: one flat category, pl = 0, gen = leaf, pref = pad_pref = G L_p,
untrim_gen = G max L_i, decode_rows = sum (L_i - 1) unless the engine preempted (the first token of
a row comes from its prompt's logits; no decode after EOS). Tree steps: tree categories only; pl0 = pl1; the per-category layout of the
table (terminal_dup: l0 = l1 = pl >= 1 and r0 = r1, one sequence graded twice; tau_zero: pl = 0;
midpoint pairs: 1 <= pl < l0; early_eos_gt104: l0 > 104); the Stage-1 origin of every inherited
token (causal_non_eos: pl <= |p^(k)|, the prefix was cut from the root; terminal_dup:
|p^(k)| = pl; roots kept whole: |p^(k)| = l0); 1 <= |p^(k)| <= max_new_tokens;
stage2_gen = sum_cont (L_kb - pl_kb); gen, pref, pad_pref and untrim_gen by the formulas above;
the engine's counts are integers >= 0. Multi-question steps: every sub-record satisfies the
laws of its kind (the engine's work checked on the step instead), belongs to the step and
shares its optimizer step; all are flat or all are tree steps; a question runs a backward pass
iff its rewards vary (zero-variance questions contribute nothing); the step is active iff one
question is, homogeneous iff all are; the totals are the sums; flat steps decode
sum (L_i - 1) over all questions unless the engine preempted. Parallel steps: the flat laws with the summary terms
above; one phi and one standard error per path, one U(N), U(∅) and r_out per response, one
summary per response or none; Shapley steps are efficient (sum_j phi_rj = U_r(N) - U_r(∅)), exact
ones scored all R 2^K coalitions; every path's reward is lambda_p normalise(phi)_j +
lambda_o r_out,r and every summary's lambda_o r_out,r (``rlvr_fast.credit.paths``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.credit.paths import normalise
from rlvr_fast.rollouts.pairs import (
    EARLY_EOS_GT104_MIN_LENGTH,
    TREE_CATEGORIES,
    PairCategory,
    TreePair,
)


class LedgerError(AssertionError):
    """A ledger line breaks a conservation law."""


@dataclass
class ParallelStats:
    """A parallel-path step's section of its ledger line: K, how credit was computed, per path
    phi and its standard error (response-major), per response U(N), U(∅) and r_out, the
    distinct coalitions scored, and the summaries (prompt lengths with the serialised paths,
    lengths, rewards; empty under the vote aggregator)."""

    paths_per_response: int
    aggregator: str
    path_utility: str
    path_credit: str
    permutations: int
    path_reward_norm: str
    lambda_outcome: float
    lambda_path: float
    phi: list[float]
    phi_se: list[float]
    utility_full: list[float]
    utility_empty: list[float]
    r_out: list[float]
    utility_calls: int
    summary_prompt_lens: list[int]
    summary_lengths: list[int]
    summary_rewards: list[float]


class SeedFlops:
    """The seed's Out / Full / PadFull FLOPs of a ledger line from its token counts at P."""

    gen: int
    pref: int
    pad_pref: int
    untrim_gen: int
    bwd_out: int
    bwd_full: int
    params: int

    @property
    def flops_out(self) -> int:
        return (2 * self.gen + 6 * self.bwd_out) * self.params

    @property
    def flops_full(self) -> int:
        return (2 * (self.pref + self.gen) + 6 * self.bwd_full) * self.params

    @property
    def flops_pad_full(self) -> int:
        return (2 * (self.pad_pref + self.untrim_gen) + 6 * self.bwd_full) * self.params


@dataclass
class StepRecord(SeedFlops):
    step: int
    question_id: str
    rewards: list[float]
    sigma_r: float
    homogeneous: bool
    active: bool
    optimizer_step: bool
    pairs: list[list]
    prompt_len: int
    lengths: list[int]
    gen: int
    pref: int
    pad_pref: int
    untrim_gen: int
    leaf: int
    bwd_out: int
    bwd_full: int
    decode_rows: int
    max_new_tokens: int
    params: int
    loss: float | None
    grad_norm: float | None
    seconds: dict[str, float] = field(default_factory=dict)
    prefill_run: int = 0
    block_copies: int = 0
    peak_kv_blocks: int = 0
    preemptions: int = 0
    stage1_lengths: list[int] | None = None  # |p^(k)| per root; None on flat steps
    stage2_gen: int | None = None  # tokens Stage 2 sampled; None on flat steps
    parallel: ParallelStats | None = None  # parallel-path steps only

    def __post_init__(self) -> None:
        if isinstance(self.parallel, dict):  # a line read back from JSON
            self.parallel = ParallelStats(**self.parallel)

    @property
    def is_tree(self) -> bool:
        return self.stage1_lengths is not None

    @property
    def summary_tokens(self) -> int:
        """Tokens the summaries generated (0 but on summary-aggregator steps)."""
        return sum(self.parallel.summary_lengths) if self.parallel else 0

    @property
    def summary_context(self) -> int:
        """Summary prompt tokens, serialised paths included (0 but on summary-aggregator steps)."""
        return sum(self.parallel.summary_prompt_lens) if self.parallel else 0

    def to_json(self) -> dict:
        line = asdict(self)
        line.update(
            flops_out=self.flops_out, flops_full=self.flops_full, flops_pad_full=self.flops_pad_full
        )
        return line


@dataclass
class MultiQuestionRecord(SeedFlops):
    """One optimizer step over several questions (module docstring): per-question sub-records
    and the step's totals, stepping, loss, gradient norm, timings and engine counts."""

    step: int
    questions: list[StepRecord]
    zero_var_questions: int
    homogeneous: bool
    active: bool
    optimizer_step: bool
    gen: int
    pref: int
    pad_pref: int
    untrim_gen: int
    leaf: int
    bwd_out: int
    bwd_full: int
    decode_rows: int
    max_new_tokens: int
    params: int
    loss: float | None
    grad_norm: float | None
    seconds: dict[str, float] = field(default_factory=dict)
    prefill_run: int = 0
    block_copies: int = 0
    peak_kv_blocks: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.questions = [read_record(q) if isinstance(q, dict) else q for q in self.questions]

    def to_json(self) -> dict:
        line = asdict(self)
        line["questions"] = [q.to_json() for q in self.questions]
        line.update(
            flops_out=self.flops_out, flops_full=self.flops_full, flops_pad_full=self.flops_pad_full
        )
        return line


TOTALLED_FIELDS = ("gen", "pref", "pad_pref", "untrim_gen", "leaf", "bwd_out", "bwd_full")
FLOP_FIELDS = ("flops_out", "flops_full", "flops_pad_full")


def read_record(line: dict) -> StepRecord | MultiQuestionRecord:
    """A ledger line read back (the FLOPs, which the records compute, dropped)."""
    kind = MultiQuestionRecord if "questions" in line else StepRecord
    names = {f.name for f in dataclasses.fields(kind)}
    return kind(**{k: v for k, v in line.items() if k in names})


def multi_question_step_record(
    *,
    step: int,
    questions: list[StepRecord],
    active: bool,
    optimizer_step: bool,
    executed: EngineCounters,
    loss: float | None,
    grad_norm: float | None,
    seconds: dict[str, float],
) -> MultiQuestionRecord:
    """The ledger line of a multi-question step from its questions' sub-records (built with
    zero engine counts: ``executed`` is the batch's work)."""
    if len(questions) < 2:
        raise ValueError(f"a multi-question step needs at least 2 questions, got {len(questions)}")
    return MultiQuestionRecord(
        step=step,
        questions=questions,
        zero_var_questions=sum(q.homogeneous for q in questions),
        homogeneous=all(q.homogeneous for q in questions),
        active=active,
        optimizer_step=optimizer_step,
        **{name: sum(getattr(q, name) for q in questions) for name in TOTALLED_FIELDS},
        max_new_tokens=questions[0].max_new_tokens,
        params=questions[0].params,
        loss=loss,
        grad_norm=grad_norm,
        seconds=seconds,
        **executed.to_json(),
    )


def flat_step_record(
    *,
    step: int,
    question_id: str,
    rewards: list[float],
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
) -> StepRecord:
    category = PairCategory(category)
    if not category.is_flat:
        raise ValueError(f"a flat step's category must be flat or flat_warmup, got {category}")
    group = len(lengths)
    leaf = sum(lengths)
    pairs = [
        [0, 0, lengths[i], lengths[i + 1], rewards[i], rewards[i + 1], category.value]
        for i in range(0, group - 1, 2)
    ]
    return StepRecord(
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
        gen=leaf,
        pref=group * prompt_len,
        pad_pref=group * prompt_len,
        untrim_gen=group * max(lengths),
        leaf=leaf,
        bwd_out=leaf if active else 0,
        bwd_full=group * prompt_len + leaf if active else 0,
        max_new_tokens=max_new_tokens,
        params=params,
        loss=loss,
        grad_norm=grad_norm,
        seconds=seconds,
        **executed.to_json(),
    )


def parallel_step_record(
    *,
    step: int,
    question_id: str,
    rewards: list[float],
    sigma_r: float,
    homogeneous: bool,
    active: bool,
    optimizer_step: bool,
    prompt_len: int,
    lengths: list[int],
    parallel: ParallelStats,
    executed: EngineCounters,
    max_new_tokens: int,
    params: int,
    loss: float | None,
    grad_norm: float | None,
    seconds: dict[str, float],
) -> StepRecord:
    """The ledger line of a parallel-path step: ``lengths`` and ``rewards`` (returns) per path,
    response-major; ``homogeneous``: no token had a nonzero advantage."""
    paths = len(lengths)
    leaf = sum(lengths)
    summaries, contexts = parallel.summary_lengths, parallel.summary_prompt_lens
    pairs = [
        [0, 0, lengths[i], lengths[i + 1], rewards[i], rewards[i + 1], PairCategory.FLAT.value]
        for i in range(0, paths - 1, 2)
    ]
    return StepRecord(
        step=step,
        question_id=question_id,
        rewards=rewards,
        sigma_r=sigma_r,
        homogeneous=homogeneous,
        active=active,
        optimizer_step=optimizer_step,
        pairs=pairs,
        prompt_len=prompt_len,
        lengths=lengths,
        gen=leaf + sum(summaries),
        pref=paths * prompt_len + sum(contexts),
        pad_pref=paths * prompt_len + len(contexts) * max(contexts, default=0),
        untrim_gen=paths * max(lengths) + len(summaries) * max(summaries, default=0),
        leaf=leaf,
        bwd_out=leaf + sum(summaries) if active else 0,
        bwd_full=paths * prompt_len + leaf + sum(contexts) + sum(summaries) if active else 0,
        max_new_tokens=max_new_tokens,
        params=params,
        loss=loss,
        grad_norm=grad_norm,
        seconds=seconds,
        parallel=parallel,
        **executed.to_json(),
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
) -> StepRecord:
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
    gen, pref, pad_pref, untrim_gen = _tree_token_counts(
        tuples, stage1_lengths, stage2_gen, prompt_len
    )
    return StepRecord(
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


def _tree_token_counts(
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


def check_conservation(
    record: StepRecord | MultiQuestionRecord, *, engine_counts: bool = True
) -> None:
    """Raise ``LedgerError`` naming the first law (module docstring) the line breaks.
    ``engine_counts=False`` for a multi-question step's sub-record: the engine's work is the
    step's, checked there."""

    def require(condition: bool, law: str) -> None:
        if not condition:
            raise LedgerError(f"ledger step {record.step}: {law} violated")

    if isinstance(record, MultiQuestionRecord):
        _check_multi_question(record, require)
        return

    leaves = len(record.lengths)
    require(len(record.rewards) == leaves, "one reward per leaf")
    require(record.leaf == sum(record.lengths), "leaf = sum of leaf lengths")
    require([n for p in record.pairs for n in p[2:4]] == record.lengths, "pair lengths = leaves")
    require([r for p in record.pairs for r in p[4:6]] == record.rewards, "pair rewards = rewards")
    stage1_leaf = sum(p[0] + p[1] for p in record.pairs)
    stage2_leaf = sum(p[2] - p[0] + p[3] - p[1] for p in record.pairs)
    require(stage1_leaf + stage2_leaf == record.leaf, "S1_leaf + S2_leaf = leaf")
    for pl0, pl1, l0, l1, *_ in record.pairs:
        for pl, length in ((pl0, l0), (pl1, l1)):
            require(0 <= length - pl <= record.max_new_tokens - pl, "0 <= L_b - pl_b <= cap - pl_b")
    summaries = record.summary_tokens
    expected_out = record.leaf + summaries if record.active else 0
    require(
        record.bwd_out == expected_out,
        "bwd_out = leaf (+ summary tokens) on backward steps, else 0",
    )
    expected_full = (
        leaves * record.prompt_len + record.leaf + record.summary_context + summaries
        if record.active
        else 0
    )
    require(
        record.bwd_full == expected_full,
        "bwd_full = (number of leaves) L_p + leaf (+ summary prompts and tokens) on "
        "backward steps, else 0",
    )
    agree = len(set(record.rewards)) == 1 and (
        record.parallel is None or len(set(record.parallel.summary_rewards)) <= 1
    )
    require(record.homogeneous == agree, "homogeneous iff sigma_R = 0")
    for name in EngineCounters.__dataclass_fields__:
        value = getattr(record, name)
        require(isinstance(value, int) and value >= 0, f"{name} is an integer >= 0")
    if record.is_tree:
        _check_tree(record, require)
    elif record.parallel is not None:
        _check_parallel(record, require)
    else:
        _check_flat(record, require, engine_counts)


def _check_multi_question(record: MultiQuestionRecord, require) -> None:
    questions = record.questions
    require(len(questions) >= 2, "a multi-question step has at least 2 questions")
    for question in questions:
        try:
            check_conservation(question, engine_counts=False)
        except LedgerError as err:
            raise LedgerError(f"question {question.question_id}: {err}") from None
        require(question.step == record.step, "its questions belong to the step")
        require(
            question.optimizer_step == record.optimizer_step,
            "its questions share the step's optimizer step",
        )
        require(
            question.active != question.homogeneous,
            "a question runs a backward pass iff its rewards vary",
        )
        require(question.parallel is None, "questions are flat or tree steps")
    require(len({q.is_tree for q in questions}) == 1, "all questions flat or all tree steps")
    require(record.active == any(q.active for q in questions), "active iff a question is")
    require(
        record.homogeneous == all(q.homogeneous for q in questions),
        "homogeneous iff every question is",
    )
    require(
        record.zero_var_questions == sum(q.homogeneous for q in questions),
        "zero_var_questions counts the homogeneous questions",
    )
    for name in TOTALLED_FIELDS:
        require(
            getattr(record, name) == sum(getattr(q, name) for q in questions),
            f"{name} = sum over questions",
        )
    require(
        all(
            q.max_new_tokens == record.max_new_tokens and q.params == record.params
            for q in questions
        ),
        "questions share max_new_tokens and P",
    )
    for name in EngineCounters.__dataclass_fields__:
        value = getattr(record, name)
        require(isinstance(value, int) and value >= 0, f"{name} is an integer >= 0")
    if not questions[0].is_tree:
        require(
            record.preemptions > 0
            or record.decode_rows == sum(n - 1 for q in questions for n in q.lengths),
            "decode work = sum(L_i - 1) over the questions: no decode after EOS",
        )


def _check_flat(record: StepRecord, require, engine_counts: bool) -> None:
    group = len(record.lengths)
    categories = {p[6] for p in record.pairs}
    require(
        len(categories) == 1 and PairCategory(categories.pop()).is_flat,
        "a flat step has one flat category",
    )
    require(record.stage2_gen is None, "flat steps have no Stage 2")
    require(all(p[0] == p[1] == 0 for p in record.pairs), "flat steps: pl = 0")
    require(record.gen == record.leaf, "flat steps: gen = leaf")
    require(
        record.pref == record.pad_pref == group * record.prompt_len,
        "flat steps: pref = pad_pref = G L_p",
    )
    require(record.untrim_gen == group * max(record.lengths), "untrim_gen = G max L_i")
    require(
        not engine_counts
        or record.preemptions > 0
        or record.decode_rows == sum(n - 1 for n in record.lengths),
        "decode work = sum(L_i - 1): no decode after EOS",
    )


def _check_parallel(record: StepRecord, require) -> None:
    stats, paths, cap = record.parallel, len(record.lengths), record.max_new_tokens
    k = stats.paths_per_response
    require(k >= 1 and paths % k == 0, "whole responses of K paths")
    responses = paths // k
    require(
        all(p[0] == p[1] == 0 and p[6] == PairCategory.FLAT for p in record.pairs),
        "parallel paths are flat pairs: pl = 0",
    )
    require(len(stats.phi) == len(stats.phi_se) == paths, "one phi and one standard error per path")
    require(
        len(stats.utility_full) == len(stats.utility_empty) == len(stats.r_out) == responses,
        "one U(N), U(∅) and r_out per response",
    )
    summaries, contexts = stats.summary_lengths, stats.summary_prompt_lens
    require(
        len(summaries)
        == len(contexts)
        == len(stats.summary_rewards)
        == (responses if stats.aggregator == "summary" else 0),
        "one summary per response under the summary aggregator, none otherwise",
    )
    require(all(1 <= n <= cap for n in summaries), "1 <= L_s <= max_new_tokens")
    require(all(n > record.prompt_len for n in contexts), "a summary prompt extends the prompt")
    require(1 <= stats.utility_calls <= responses << k, "1 <= utility calls <= R 2^K")
    exact = stats.path_credit == "shapley" and stats.permutations == 0
    require(not exact or stats.utility_calls == responses << k, "exact Shapley scores all R 2^K")
    for r in range(responses):
        phi = stats.phi[r * k : (r + 1) * k]
        if stats.path_credit == "shapley":
            scale = max(1.0, abs(stats.utility_full[r]), abs(stats.utility_empty[r]))
            require(
                abs(sum(phi) - (stats.utility_full[r] - stats.utility_empty[r]))
                <= 1e-9 * k * scale,
                "Shapley efficiency: sum_j phi_rj = U_r(N) - U_r(∅)",
            )
        expected = (
            stats.lambda_path * normalise(phi, stats.path_reward_norm)
            + stats.lambda_outcome * stats.r_out[r]
        ).tolist()
        require(
            all(abs(a - b) <= 1e-5 for a, b in zip(record.rewards[r * k : (r + 1) * k], expected)),
            "path reward = lambda_p normalise(phi)_j + lambda_o r_out",
        )
    require(
        all(
            abs(s - stats.lambda_outcome * r) <= 1e-6
            for s, r in zip(stats.summary_rewards, stats.r_out)
        ),
        "summary reward = lambda_o r_out",
    )
    require(record.stage2_gen is None, "parallel steps have no Stage 2")
    require(record.gen == record.leaf + sum(summaries), "gen = leaf + sum L_s")
    require(record.pref == paths * record.prompt_len + sum(contexts), "pref = R K L_p + sum L_sp")
    require(
        record.pad_pref == paths * record.prompt_len + len(contexts) * max(contexts, default=0),
        "pad_pref = R K L_p + R_s max L_sp",
    )
    require(
        record.untrim_gen
        == paths * max(record.lengths) + len(summaries) * max(summaries, default=0),
        "untrim_gen = R K max L + R_s max L_s",
    )
    require(
        record.preemptions > 0
        or record.decode_rows == sum(n - 1 for n in record.lengths) + sum(n - 1 for n in summaries),
        "decode work = sum(L_i - 1) + sum(L_s - 1): no decode after EOS",
    )
    require(
        record.preemptions > 0
        or record.prefill_run == record.prompt_len + sum(n - record.prompt_len for n in contexts),
        "prefill_run = L_p + sum (L_sp - L_p): the prompt once, each summary its paths",
    )


def _check_tree(record: StepRecord, require) -> None:
    cap = record.max_new_tokens
    require(len(record.stage1_lengths) == len(record.pairs) >= 1, "one Stage-1 root per pair")
    require(all(p[6] in TREE_CATEGORIES for p in record.pairs), "tree categories only")
    for (pl0, pl1, l0, l1, r0, r1, category), root in zip(record.pairs, record.stage1_lengths):
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
    sampled = sum(length - pl for pl, length in continued_branches(record.pairs))
    require(record.stage2_gen == sampled, "stage2_gen = sum over continued branches of L - pl")
    gen, pref, pad_pref, untrim_gen = _tree_token_counts(
        record.pairs, record.stage1_lengths, record.stage2_gen, record.prompt_len
    )
    require(record.gen == gen, "gen = sum |p^(k)| + stage2_gen")
    require(record.pref == pref, "pref = K L_p + sum_cont (L_p + pl)")
    require(record.pad_pref == pad_pref, "pad_pref = K L_p + B_cont max_cont (L_p + pl)")
    require(
        record.untrim_gen == untrim_gen, "untrim_gen = K max |p^(k)| + B_cont max_cont (L - pl)"
    )


class LedgerWriter:
    """Appends checked lines to ``ledger.jsonl``; each line is flushed and fsynced, so a kill
    leaves at most a partial last line, which a resume drops
    (``rlvr_fast.run.directory.whole_lines``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: StepRecord | MultiQuestionRecord) -> None:
        check_conservation(record)
        self.file.write(json.dumps(record.to_json()) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()
