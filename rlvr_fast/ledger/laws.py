"""The ledger's conservation laws (``rlvr_fast.ledger.records`` defines the figures).

``check_conservation`` enforces the laws every line must satisfy; a violation is a bug in the
trainer or the sampler, so writing raises instead of recording a wrong line. Laws on every
question's line: one reward and one length per leaf, the tuples list exactly them;
S1_leaf + S2_leaf = leaf; 0 <= L_b - pl_b <= max_new_tokens - pl_b; bwd_out and bwd_full as in
the records (a step of generation_steps > 1 lists the completions it trained on, ``trained``:
distinct, in leaf order, and bwd_out and bwd_full count only those); homogeneous iff all rewards
agree; the engine's counts are integers >= 0; then the laws of its kind, which its record holds
(``StepRecord.kind_laws``, registered from the kind's side: ``rlvr_fast.train.kinds``).
A step on TRL's loss types may carry a ``policy`` section: entropy >= 0, kl >= 0, clip ratios
in [0, 1] with region = low + high. Multi-question steps: every sub-record satisfies the
laws of its kind (the engine's work checked on the step instead), belongs to the step and
shares its optimizer step; all are records of one kind, of a kind that pools questions; a
question runs a backward pass iff its rewards vary (zero-variance questions contribute nothing)
and the step trains on one of its completions; the step is active iff one question is,
homogeneous iff all are (or a KL term pulls every question: kl_beta > 0); the totals are the
sums; where their kind says what the engine decodes for each question, the step decodes their
sum unless the engine preempted.
"""

from __future__ import annotations

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.ledger.records import (
    POLICY_FIGURES,
    TOTALLED_FIELDS,
    LedgerError,
    LedgerRecord,
    MultiQuestionRecord,
    StepRecord,
)


def check_conservation(record: LedgerRecord, *, engine_counts: bool = True) -> None:
    """Raise ``LedgerError`` naming the first law (module docstring) the line breaks.
    ``engine_counts=False`` for a multi-question step's sub-record: the engine's work is the
    step's, checked there."""

    def require(condition: bool, law: str) -> None:
        if not condition:
            raise LedgerError(f"ledger step {record.step}: {law} violated")

    if record.policy is not None:
        _check_policy(record.policy, require)
    if isinstance(record, MultiQuestionRecord):
        _check_multi_question(record, require)
        return
    _check_question(record, require)
    record.kind_laws(require, engine_counts)


def _check_question(record: StepRecord, require) -> None:
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
    trained = record.trained_lengths
    require(
        record.trained is None
        or (
            record.trained == sorted(set(record.trained))
            and all(0 <= i < leaves for i in record.trained)
        ),
        "trained lists distinct completions in leaf order",
    )
    extra_out, extra_read = record.beyond_leaves()
    expected_out = sum(trained) + extra_out if record.active else 0
    require(
        record.bwd_out == expected_out,
        "bwd_out = leaf (+ summary tokens; the trained leaves') on backward steps, else 0",
    )
    expected_full = (
        len(trained) * record.prompt_len + sum(trained) + extra_read if record.active else 0
    )
    require(
        record.bwd_full == expected_full,
        "bwd_full = (number of leaves) L_p + leaf (+ summary prompts and tokens; of the "
        "trained leaves) on backward steps, else 0",
    )
    # A completion no reward function scored (null) is left out, as it is of sigma_R.
    require(record.homogeneous == record.rewards_agree(), "homogeneous iff sigma_R = 0")
    _check_engine_counts(record, require)


def _check_engine_counts(record: LedgerRecord, require) -> None:
    for name in EngineCounters.__dataclass_fields__:
        value = getattr(record, name)
        require(isinstance(value, int) and value >= 0, f"{name} is an integer >= 0")


def _check_policy(policy: dict, require) -> None:
    require(set(policy) <= set(POLICY_FIGURES), "policy figures have TRL's names")
    require(0 <= policy.get("high_entropy_fraction", 0.0) <= 1, "high_entropy_fraction in [0, 1]")
    require(policy.get("entropy", 0.0) >= 0 and policy.get("kl", 0.0) >= 0, "entropy, kl >= 0")
    ratios = [v for name, v in policy.items() if "clip_ratio" in name]
    require(all(0 <= v <= 1 for v in ratios), "clip ratios in [0, 1]")
    if "clip_ratio/region_mean" in policy:
        low, high = policy["clip_ratio/low_mean"], policy["clip_ratio/high_mean"]
        require(
            abs(policy["clip_ratio/region_mean"] - low - high) <= 1e-6,
            "clip region = low + high (a ratio clips low only on a negative advantage)",
        )


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
            question.active
            == (
                (
                    not question.homogeneous
                    or bool({"kl", "entropy_coef"} & set(record.policy or {}))
                )
                and question.trained != []
            ),
            "a question runs a backward pass iff its rewards vary or a KL term or an entropy "
            "bonus pulls it, and "
            "the step trains on one of its completions",
        )
    require(len({type(q) for q in questions}) == 1, "all questions are records of one kind")
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
    _check_engine_counts(record, require)
    require(len({q.reused for q in questions}) == 1, "its questions are all sampled or all reused")
    if questions[0].reused:
        require(record.decode_rows == 0, "a reused step decodes nothing")
        return
    decoded = [q.expected_decode_rows() for q in questions]
    if None not in decoded:
        require(
            record.preemptions > 0 or record.decode_rows == sum(decoded),
            "decode work = sum(L_i - 1) over the questions: no decode after EOS",
        )
