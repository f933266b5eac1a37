"""The ledger's conservation laws (``rlvr_fast.ledger.records`` defines the figures).

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
the engine's counts are integers >= 0. A flat step ``reused`` (an update of num_iterations on an
earlier step's rollouts, or a later step of a generation of generation_steps > 1) samples
nothing: gen = pref = pad_pref = untrim_gen = decode_rows = 0; a step of generation_steps > 1
lists the completions it trained on (``trained``: distinct, in leaf order), and bwd_out and
bwd_full count only those.
A step on TRL's loss types may carry a ``policy`` section: entropy >= 0, kl >= 0, clip ratios
in [0, 1] with region = low + high. Multi-question steps: every sub-record satisfies the
laws of its kind (the engine's work checked on the step instead), belongs to the step and
shares its optimizer step; all are flat or all are tree steps; a question runs a backward pass
iff its rewards vary (zero-variance questions contribute nothing) and the step trains on one of
its completions; the step is active iff one
question is, homogeneous iff all are (or a KL term pulls every question: kl_beta > 0); the totals are the sums; flat steps decode
sum (L_i - 1) over all questions unless the engine preempted. Parallel steps: the flat laws with the summary terms
above; one phi and one standard error per path, one U(N), U(∅) and r_out per response, one
summary per response or none; Shapley steps are efficient (sum_j phi_rj = U_r(N) - U_r(∅)), exact
ones scored all R 2^K coalitions; every path's reward is lambda_p normalise(phi)_j +
lambda_o r_out,r and every summary's lambda_o r_out,r (``rlvr_fast.credit.paths``).
"""

from __future__ import annotations

from rlvr_fast.credit.paths import normalise
from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.ledger.records import (
    POLICY_FIGURES,
    TOTALLED_FIELDS,
    LedgerError,
    MultiQuestionRecord,
    StepRecord,
    tree_token_counts,
    continued_branches,
)
from rlvr_fast.rollouts.pairs import EARLY_EOS_GT104_MIN_LENGTH, TREE_CATEGORIES, PairCategory


def check_conservation(
    record: StepRecord | MultiQuestionRecord, *, engine_counts: bool = True
) -> None:
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
    trained = record.trained_lengths
    require(
        record.trained is None
        or (
            record.trained == sorted(set(record.trained))
            and all(0 <= i < leaves for i in record.trained)
        ),
        "trained lists distinct completions in leaf order",
    )
    expected_out = sum(trained) + summaries if record.active else 0
    require(
        record.bwd_out == expected_out,
        "bwd_out = leaf (+ summary tokens; the trained leaves') on backward steps, else 0",
    )
    expected_full = (
        len(trained) * record.prompt_len + sum(trained) + record.summary_context + summaries
        if record.active
        else 0
    )
    require(
        record.bwd_full == expected_full,
        "bwd_full = (number of leaves) L_p + leaf (+ summary prompts and tokens; of the "
        "trained leaves) on backward steps, else 0",
    )
    # A completion no reward function scored (null) is left out, as it is of sigma_R.
    agree = len({r for r in record.rewards if r is not None}) <= 1 and (
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
    require(len({q.reused for q in questions}) == 1, "its questions are all sampled or all reused")
    if questions[0].reused:
        require(record.decode_rows == 0, "a reused step decodes nothing")
    elif not questions[0].is_tree:
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
    if record.reused:
        require(
            record.gen == record.pref == record.pad_pref == record.untrim_gen == 0,
            "a reused step samples nothing: gen = pref = pad_pref = untrim_gen = 0",
        )
        require(not engine_counts or record.decode_rows == 0, "a reused step decodes nothing")
        return
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
    gen, pref, pad_pref, untrim_gen = tree_token_counts(
        record.pairs, record.stage1_lengths, record.stage2_gen, record.prompt_len
    )
    require(record.gen == gen, "gen = sum |p^(k)| + stage2_gen")
    require(record.pref == pref, "pref = K L_p + sum_cont (L_p + pl)")
    require(record.pad_pref == pad_pref, "pad_pref = K L_p + B_cont max_cont (L_p + pl)")
    require(
        record.untrim_gen == untrim_gen, "untrim_gen = K max |p^(k)| + B_cont max_cont (L - pl)"
    )
