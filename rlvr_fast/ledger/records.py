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

A question's line is a ``StepRecord``; each step kind registers its own subclass
(``register_record``, from the kind's side: the ledger imports nothing of the kinds) holding the
fields of its own, how gen, pref, pad_pref and untrim_gen follow from them, and its laws
(``kind_laws``): ``rlvr_fast.train.kinds.flat_record`` (flat groups), ``tree_record`` (two-stage
trees), ``parallel_record`` (parallel paths). A line read back is the registered record one of
whose own fields it sets (the one with none of its own otherwise).

Alongside the seed's formulas every record keeps what our engine executed, under the engine's
own names (``rlvr_fast.engine.EngineCounters``, reported, not derived): ``prefill_run`` (prefill
tokens actually run: |prompt| for a group that prefills its prompt once and forks it, no Stage-2
prefill at all for forked trees), ``decode_rows`` (rows x decode steps), ``block_copies``,
``peak_kv_blocks`` and ``preemptions``.

Multi-question steps (``multi_question_step_record``, ``questions_per_step`` Q > 1): one line per
optimizer step (``MultiQuestionRecord``) holding one sub-record per question (``questions``, each
a ``StepRecord`` of that question, its ``loss`` the question's loss and its
``grad_norm`` the norm of its gradient before unit scaling) and the step's totals: gen, pref,
pad_pref, untrim_gen, leaf, bwd_out and bwd_full are the sums over its questions,
``zero_var_questions`` counts the homogeneous ones, ``loss`` is the unit-normalised surrogate
(1/n) sum_q L_q / |g_q| over the n questions that contributed and ``grad_norm`` the norm of
their averaged unit gradients before clipping. The Q questions are sampled in one batch, so the
engine's counts are the step's and a sub-record's are 0. A data-parallel step
(``rlvr_fast.train.distributed``) is the same line with the questions of every rank in step order; its
engine counts are the ranks' summed (``peak_kv_blocks`` the sum of each rank's peak) and its
timings rank 0's, with an ``all_reduce`` phase on active steps.

A line's keys come in a fixed order (``LedgerRecord.keys``), not the records' field order:
ledgers written before the records shared a base keep their bytes. The laws every line
satisfies are ``rlvr_fast.ledger.laws``; ``rlvr_fast.ledger.writer`` appends checked lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.ops.loss_types import LOSS_TYPE_FIGURES


class LedgerError(AssertionError):
    """A ledger line breaks a conservation law."""


TOTALLED_FIELDS = ("gen", "pref", "pad_pref", "untrim_gen", "leaf", "bwd_out", "bwd_full")
FLOP_FIELDS = ("flops_out", "flops_full", "flops_pad_full")
# What a line holds of the work of its step, in its keys' order (the engine's counts among them).
WORK_KEYS = (
    *TOTALLED_FIELDS,
    "decode_rows",
    "max_new_tokens",
    "params",
    "loss",
    "grad_norm",
    "seconds",
    "prefill_run",
    "block_copies",
    "peak_kv_blocks",
    "preemptions",
)
# What nothing on disk but the line itself determines (timings, loss, gradient norm, the engine's
# counts, TRL's figures, the loss scale): ``verify`` re-derives every other field.
RECORDED_ONLY = (
    "decode_rows",
    "loss",
    "grad_norm",
    "seconds",
    "prefill_run",
    "block_copies",
    "peak_kv_blocks",
    "preemptions",
    "policy",
    "loss_scale",
)
# Every question's line has carried the tree kind's and the parallel kind's fields, null on the
# other kinds' lines, since before kinds registered their records: kept, so that ledgers keep
# their bytes. A record's other fields of its own follow them.
EARLY_KIND_KEYS = ("stage1_lengths", "stage2_gen", "parallel")


@dataclass(kw_only=True)
class LedgerRecord:
    """What every ledger line holds, of one question (``StepRecord``) or of several
    (``MultiQuestionRecord``): its stepping, token counts (and from them the seed's Out / Full /
    PadFull FLOPs at P), loss, gradient norm, timings, the engine's counts and, on TRL's loss types, its ``policy`` figures (POLICY_FIGURES; fp16-mixed:
    ``loss_scale``, {"scale": the step's loss scale, "skipped": its gradients overflowed})."""

    step: int
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
    policy: dict[str, float] | None = None
    loss_scale: dict | None = None

    @property
    def flops_out(self) -> int:
        """The seed's Out FLOPs of the line, from its token counts at P."""
        return (2 * self.gen + 6 * self.bwd_out) * self.params

    @property
    def flops_full(self) -> int:
        return (2 * (self.pref + self.gen) + 6 * self.bwd_full) * self.params

    @property
    def flops_pad_full(self) -> int:
        return (2 * (self.pad_pref + self.untrim_gen) + 6 * self.bwd_full) * self.params

    def keys(self) -> tuple[str, ...]:
        """The line's keys in the order it writes them (before the FLOPs)."""
        raise NotImplementedError

    def values(self) -> dict:
        """The fields as JSON values."""
        return asdict(self)

    def to_json(self) -> dict:
        values = self.values()
        line = without_empty_policy({key: values.get(key) for key in self.keys()})
        line.update(
            flops_out=self.flops_out, flops_full=self.flops_full, flops_pad_full=self.flops_pad_full
        )
        return line

    def derived_fields(self) -> tuple[str, ...]:
        """The keys ``verify`` re-derives from rollouts.jsonl and config.json, in line order."""
        return (*(k for k in self.keys() if k not in RECORDED_ONLY), *FLOP_FIELDS)


@dataclass(kw_only=True)
class StepRecord(LedgerRecord):
    """One question's line: its rollouts' rewards (null: no reward function scored it), sigma_R,
    pair tuples, prompt length and leaf lengths; ``reused``: an update on an earlier step's
    rollouts (num_iterations, generation_steps); ``trained``: the completions this step trained
    on (generation_steps > 1: its share of the generation, leaf order; None: all). A kind's
    record subclasses it with the fields of its own and its laws, and registers
    (``register_record``)."""

    question_id: str
    rewards: list[float | None]
    sigma_r: float
    pairs: list[list]
    prompt_len: int
    lengths: list[int]
    reused: bool = False
    trained: list[int] | None = None

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        """The fields of the kind's record beyond every question's."""
        shared = {f.name for f in dataclasses.fields(StepRecord)}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in shared)

    def keys(self) -> tuple[str, ...]:
        own = tuple(name for name in self.own_fields() if name not in EARLY_KIND_KEYS)
        return (
            "step",
            "question_id",
            "rewards",
            "sigma_r",
            "homogeneous",
            "active",
            "optimizer_step",
            "pairs",
            "prompt_len",
            "lengths",
            *WORK_KEYS,
            *EARLY_KIND_KEYS,
            *own,
            "policy",
            "reused",
            "trained",
            "loss_scale",
        )

    @property
    def trained_lengths(self) -> list[int]:
        """The lengths of the completions the step trained on."""
        if self.trained is None:
            return self.lengths
        return [self.lengths[i] for i in self.trained]

    def beyond_leaves(self) -> tuple[int, int]:
        """What the backward pass ran on beyond the trained leaves and their prompts: (tokens
        it trained on, tokens it read); 0, 0 but on kinds that train on more."""
        return 0, 0

    def rewards_agree(self) -> bool:
        """Every reward a function scored is the same (the step is homogeneous)."""
        return len({r for r in self.rewards if r is not None}) <= 1

    def expected_decode_rows(self) -> int | None:
        """The rows the engine decodes for this question when it preempts nothing; None: its
        kind's laws bound them otherwise."""
        return None

    def kind_laws(self, require: Callable[[bool, str], None], engine_counts: bool) -> None:
        """The laws of the record's kind beyond every question's (``rlvr_fast.ledger.laws``);
        ``require(condition, law)`` raises naming the law. ``engine_counts=False``: the engine's
        work is the step's, checked there."""
        raise NotImplementedError(f"{type(self).__name__} is the record of no step kind")


@dataclass(kw_only=True)
class MultiQuestionRecord(LedgerRecord):
    """One optimizer step over several questions (module docstring): per-question sub-records
    and the step's totals, stepping, loss, gradient norm, timings and engine counts."""

    questions: list[StepRecord]
    zero_var_questions: int

    def __post_init__(self) -> None:
        self.questions = [read_record(q) if isinstance(q, dict) else q for q in self.questions]

    def keys(self) -> tuple[str, ...]:
        return (
            "step",
            "questions",
            "zero_var_questions",
            "homogeneous",
            "active",
            "optimizer_step",
            *WORK_KEYS,
            "policy",
            "loss_scale",
        )

    def values(self) -> dict:
        return dict(super().values(), questions=[q.to_json() for q in self.questions])


# The kinds' records (``register_record``), in registration order.
RECORDS: list[type[StepRecord]] = []


def register_record(record: type[StepRecord]) -> type[StepRecord]:
    """Register a step kind's ledger record (a decorator on its ``StepRecord`` subclass): lines
    are read back as it when they set one of its own fields, and checked by its ``kind_laws``.
    Its own fields are no other record's; one record may have none (the flat one)."""
    if not (isinstance(record, type) and issubclass(record, StepRecord)):
        raise TypeError(f"{record!r} is not a StepRecord")
    own = set(record.own_fields())
    for known in RECORDS:
        if known.__name__ == record.__name__:
            raise ValueError(f"ledger record {record.__name__} is registered twice")
        clash = own & set(known.own_fields())
        if clash or not (own or known.own_fields()):
            raise ValueError(
                f"ledger record {record.__name__} cannot be told apart from "
                f"{known.__name__} (own fields {sorted(own)})"
            )
    RECORDS.append(record)
    return record


def record_of_line(line: dict) -> type[StepRecord]:
    """The registered record of a question's line: the one whose own fields it sets (a
    TypeError, as for a line with other fields than a record's, when it sets two records')."""
    setting = [r for r in RECORDS if any(line.get(n) is not None for n in r.own_fields())]
    if len(setting) > 1:
        raise TypeError(f"the line sets fields of {setting[0].__name__} and {setting[1].__name__}")
    plain = [r for r in RECORDS if not r.own_fields()]
    if not setting + plain:
        raise RuntimeError(
            "no step kind registered a ledger record for this line (import rlvr_fast.train.kinds)"
        )
    return (setting + plain)[0]


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


def read_record(line: dict) -> LedgerRecord:
    """A ledger line read back (the FLOPs, which the records compute, dropped)."""
    kind = MultiQuestionRecord if "questions" in line else record_of_line(line)
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
