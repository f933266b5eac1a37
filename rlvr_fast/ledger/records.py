"""The per-step ledger (seed §5.1): token counts, FLOPs and timings, one JSON line per step.

Every step stores per-pair tuples [pl0, pl1, l0, l1, r0, r1, category]: prefix length, leaf
length and reward of branches 0 and 1 of the pair. FLOPs at P trainable parameters:
Out = (2 gen + 6 bwd_out) P, Full = (2 (pref + gen) + 6 bwd_full) P,
PadFull = (2 (pad_pref + untrim_gen) + 6 bwd_full) P. On every step, with leaves of lengths L and
a prompt of L_p tokens: leaf = sum L; bwd_out = leaf and bwd_full = (number of leaves) L_p + leaf
on steps that run a backward pass, else 0. A flat step of ``generation_steps`` S > 1 trains on its
share of the generation's completions (``trained``, their indices: the generation's shuffle,
``rlvr_fast.train.steps.generation_shares``): bwd_out and bwd_full count those only, and every
step after the generation's first is ``reused`` as under num_iterations.

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

The laws every line satisfies are ``rlvr_fast.ledger.laws``; ``rlvr_fast.ledger.writer``
appends checked lines.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from rlvr_fast.ops.loss_types import LOSS_TYPE_FIGURES
from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.rollouts.pairs import TREE_CATEGORIES, PairCategory, TreePair


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
    rewards: list[float | None]  # null: no reward function scored it
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
    policy: dict[str, float] | None = None  # TRL's loss types: POLICY_FIGURES of every step
    reused: bool = False  # an update on an earlier step's rollouts (num_iterations)
    # The completions this step trained on (generation_steps > 1: its share of the generation,
    # leaf order); None: all of them.
    trained: list[int] | None = None
    # fp16-mixed: {"scale": the loss scale of the step, "skipped": its gradients overflowed}.
    loss_scale: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.parallel, dict):  # a line read back from JSON
            self.parallel = ParallelStats(**self.parallel)
        elif self.parallel is not None and not isinstance(self.parallel, ParallelStats):
            raise TypeError(f"parallel is {self.parallel!r}, not an object or null")

    @property
    def is_tree(self) -> bool:
        return self.stage1_lengths is not None

    @property
    def trained_lengths(self) -> list[int]:
        """The lengths of the completions the step trained on."""
        if self.trained is None:
            return self.lengths
        return [self.lengths[i] for i in self.trained]

    @property
    def summary_tokens(self) -> int:
        """Tokens the summaries generated (0 but on summary-aggregator steps)."""
        return sum(self.parallel.summary_lengths) if self.parallel else 0

    @property
    def summary_context(self) -> int:
        """Summary prompt tokens, serialised paths included (0 but on summary-aggregator steps)."""
        return sum(self.parallel.summary_prompt_lens) if self.parallel else 0

    def to_json(self) -> dict:
        line = without_empty_policy(asdict(self))
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
    policy: dict[str, float] | None = None  # as StepRecord's, over the step's questions
    loss_scale: dict | None = None  # as StepRecord's

    def __post_init__(self) -> None:
        self.questions = [read_record(q) if isinstance(q, dict) else q for q in self.questions]

    def to_json(self) -> dict:
        line = without_empty_policy(asdict(self))
        line["questions"] = [q.to_json() for q in self.questions]
        line.update(
            flops_out=self.flops_out, flops_full=self.flops_full, flops_pad_full=self.flops_pad_full
        )
        return line


# The policy figures of a step on TRL's loss types, TRL's metric names (rlvr_fast.train.policy);
# each loss type's own are its record's (rlvr_fast.ops.loss_types).
POLICY_FIGURES = (
    "entropy",
    "kl",
    *LOSS_TYPE_FIGURES,
    "entropy_coef",
    "policy_loss",
    # rlvr_fast's: the share of the step's tokens in the policy term (top_entropy_quantile < 1).
    "high_entropy_fraction",
    # rlvr_fast's: the entropy TRL's adaptive control measured (over those tokens) this step.
    "policy_term_entropy",
)


def without_empty_policy(line: dict) -> dict:
    """A line without its policy section or loss scale when it has none, without ``reused``
    when false and without ``trained`` when the step trained on every completion (the study's
    arms write none of them)."""
    for name in ("policy", "loss_scale"):
        if line.get(name) is None:
            line.pop(name, None)
    if "trained" in line and line["trained"] is None:
        line.pop("trained")
    if not line.get("reused", True):
        line.pop("reused")
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
) -> StepRecord:
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
    gen, pref, pad_pref, untrim_gen = tree_token_counts(
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
