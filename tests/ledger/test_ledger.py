"""Step ledger: tree steps of every category against hand-computed seed formulas, the
conservation laws, and flat records (flat and flat_warmup)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from rlvr_fast.engine import EngineCounters
from rlvr_fast.ledger.writer import LedgerWriter
from rlvr_fast.ledger.laws import check_conservation
from rlvr_fast.ledger.records import (
    LedgerError,
    MultiQuestionRecord,
    multi_question_step_record,
    read_record,
)
from rlvr_fast.train.kinds.flat_record import FlatRecord, flat_step_record
from rlvr_fast.train.kinds.tree_record import TreeRecord, tree_step_record
from rlvr_fast.rollouts.pairs import TreePair

PARAMS = 10
COMMON = dict(
    step=7,
    question_id="q7",
    optimizer_step=True,
    max_new_tokens=512,
    params=PARAMS,
    loss=0.5,
    grad_norm=1.0,
    seconds={"rollout": 1.0},
    executed=EngineCounters(),
)


def pair(category: str, prefix_len: int, lengths: tuple[int, ...], stage1_len: int) -> TreePair:
    """A tree pair with placeholder tokens: the ledger reads only lengths and categories."""
    return TreePair(
        category, prefix_len, [7] * stage1_len, [[7] * n for n in lengths], ["eos"] * len(lengths)
    )


def tree_record(pairs, rewards, *, prompt_len, stage2_gen, active=True, **overrides):
    fields = dict(
        COMMON,
        rewards=rewards,
        sigma_r=0.0 if len(set(rewards)) == 1 else 0.5,
        active=active,
        prompt_len=prompt_len,
        pairs=pairs,
        stage2_gen=stage2_gen,
    )
    fields.update(overrides)
    return tree_step_record(**fields)


def stopped_tree_step(**overrides):
    pairs = [
        pair("causal_non_eos", 120, (300, 200), 160),
        pair("causal_non_eos", 100, (512, 150), 140),
        pair("terminal_dup", 40, (40, 40), 40),
        pair("causal_non_eos", 150, (151, 400), 160),
    ]
    # Stage 2 sampled (300-120) + (200-120) + (512-100) + (150-100) + (151-150) + (400-150).
    fields = dict(
        pairs=pairs, rewards=[1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], prompt_len=50, stage2_gen=973
    )
    fields.update(overrides)
    return tree_record(**fields)


def test_stopped_tree_step_causal_and_terminal_dup():
    record = stopped_tree_step()
    check_conservation(record)
    assert record.pairs[2] == [40, 40, 40, 40, 0.0, 0.0, "terminal_dup"]
    assert record.lengths == [300, 200, 512, 150, 40, 40, 151, 400]
    assert record.stage1_lengths == [160, 140, 40, 160]
    assert record.leaf == 1793
    assert record.gen == 500 + 973  # sum |p^(k)| + Stage 2
    assert record.pref == 4 * 50 + 2 * 170 + 2 * 150 + 2 * 200 == 1240
    assert record.pad_pref == 4 * 50 + 6 * 200 == 1400  # 6 continued branches, widest 50 + 150
    assert record.untrim_gen == 4 * 160 + 6 * 412 == 3112
    assert record.bwd_out == 1793 and record.bwd_full == 8 * 50 + 1793
    assert record.flops_out == (2 * 1473 + 6 * 1793) * PARAMS == 137040
    assert record.flops_full == (2 * (1240 + 1473) + 6 * 2193) * PARAMS == 185840
    assert record.flops_pad_full == (2 * (1400 + 3112) + 6 * 2193) * PARAMS == 221820


def test_root_restart_step_tau_zero_on_a_skipped_homogeneous_group():
    pairs = [pair("causal_non_eos", 100, (200, 250), 160), pair("tau_zero", 0, (60, 300), 60)]
    # Branch 0 of the tau_zero pair is the 60-token root; Stage 2 sampled 100 + 150 + 300.
    record = tree_record(pairs, [0.0] * 4, prompt_len=30, stage2_gen=550, active=False)
    check_conservation(record)
    assert record.homogeneous and record.bwd_out == record.bwd_full == 0
    assert record.gen == 220 + 550 == 770
    assert record.leaf == 810
    # S2_leaf (tuples) counts branch 0's 60 Stage-1 tokens too; stage2_gen does not.
    assert sum(p[2] - p[0] + p[3] - p[1] for p in record.pairs) == 610
    assert record.pref == 2 * 30 + 130 + 130 + 30 == 350  # the fresh branch re-prefills the prompt
    assert record.pad_pref == 2 * 30 + 3 * 130 == 450
    assert record.untrim_gen == 2 * 160 + 3 * 300 == 1220


def test_midpoint_step_midpoint_fallback_and_early_eos_gt104():
    pairs = [
        pair("midpoint_fallback", 40, (80, 240), 80),
        pair("early_eos_gt104", 100, (130, 110), 130),
        pair("causal_non_eos", 96, (97, 512), 160),
    ]
    record = tree_record(
        pairs, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], prompt_len=20, stage2_gen=200 + 10 + 1 + 416
    )
    check_conservation(record)
    assert record.gen == 370 + 627 == 997
    assert record.leaf == 1169
    assert record.pref == 3 * 20 + 60 + 120 + 116 + 116 == 472
    assert record.pad_pref == 3 * 20 + 4 * 120 == 540
    assert record.untrim_gen == 3 * 160 + 4 * 416 == 2144
    assert record.bwd_full == 6 * 20 + 1169


def test_flat_warmup_step_of_a_tree_arm():
    record = flat_step_record(
        step=0,
        question_id="q0",
        rewards=[1.0, 0.0, 0.0, 0.0],
        sigma_r=0.5,
        active=True,
        optimizer_step=True,
        prompt_len=10,
        lengths=[5, 3, 4, 2],
        max_new_tokens=512,
        params=PARAMS,
        loss=0.1,
        grad_norm=1.0,
        seconds={},
        category="flat_warmup",
        executed=EngineCounters(prefill_run=40, decode_rows=4 + 2 + 3 + 1, peak_kv_blocks=3),
    )
    check_conservation(record)
    assert record.pairs == [
        [0, 0, 5, 3, 1.0, 0.0, "flat_warmup"],
        [0, 0, 4, 2, 0.0, 0.0, "flat_warmup"],
    ]
    assert (record.gen, record.pref, record.pad_pref, record.untrim_gen) == (14, 40, 40, 20)
    assert record.bwd_full == 40 + 14 and record.to_json()["stage1_lengths"] is None


def test_tree_records_round_trip_through_the_writer(tmp_path):
    writer = LedgerWriter(tmp_path / "ledger.jsonl")
    writer.write(stopped_tree_step())
    writer.close()
    line = json.loads((tmp_path / "ledger.jsonl").read_text())
    record = read_record(line)
    assert isinstance(record, TreeRecord)
    check_conservation(record)
    assert line["flops_pad_full"] == 221820


@st.composite
def tree_pairs(draw):
    """A pair of any category laid out as the module table says, cap 512."""
    category = draw(
        st.sampled_from(
            ["causal_non_eos", "terminal_dup", "tau_zero", "midpoint_fallback", "early_eos_gt104"]
        )
    )
    if category == "causal_non_eos":
        root = draw(st.integers(1, 160))
        tau = draw(st.integers(1, root))
        lengths = (draw(st.integers(tau, 512)), draw(st.integers(tau, 512)))
        return pair(category, tau, lengths, root)
    if category == "terminal_dup":
        eos = draw(st.integers(1, 160))
        return pair(category, eos, (eos, eos), eos)
    if category == "tau_zero":
        eos = draw(st.integers(1, 160))
        return pair(category, 0, (eos, draw(st.integers(1, 512))), eos)
    eos = draw(st.integers(105 if category == "early_eos_gt104" else 2, 512))
    split = draw(st.integers(1, eos - 1))
    return pair(category, split, (eos, draw(st.integers(split, 512))), eos)


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(tree_pairs(), min_size=1, max_size=6), prompt_len=st.integers(1, 300))
def test_every_leaf_token_is_inherited_sampled_in_stage_2_or_kept_from_stage_1(pairs, prompt_len):
    continued = {
        "causal_non_eos": (0, 1),
        "tau_zero": (1,),
        "midpoint_fallback": (1,),
        "early_eos_gt104": (1,),
        "terminal_dup": (),
    }
    stage2_gen = sum(p.lengths[b] - p.prefix_len for p in pairs for b in continued[p.category])
    rewards = [float(k % 2) for k in range(len(pairs)) for _ in range(2)]  # terminal_dup: r0 = r1
    record = tree_record(pairs, rewards, prompt_len=prompt_len, stage2_gen=stage2_gen)
    check_conservation(record)
    shared = sum(2 * p.prefix_len for p in pairs)
    kept = sum(
        p.lengths[0] - p.prefix_len
        for p in pairs
        if p.category in ("tau_zero", "midpoint_fallback", "early_eos_gt104")
    )
    assert record.leaf == shared + record.stage2_gen + kept
    assert record.gen >= record.stage2_gen + kept  # kept tokens came out of Stage 1
    # Padding and batch-max decoding only ever add work.
    assert record.pad_pref >= record.pref and record.untrim_gen >= record.gen


def violates(record, law):
    with pytest.raises(LedgerError, match=law):
        check_conservation(record)


@pytest.mark.parametrize(
    "pair,law",
    [
        (pair("terminal_dup", 40, (40, 40), 41), "terminal_dup: pl = L"),
        (pair("terminal_dup", 40, (40, 41), 40), "terminal_dup: pl = L"),
        (pair("causal_non_eos", 150, (160, 160), 140), "1 <= tau_k <= \\|p\\^\\(k\\)\\|"),
        (pair("causal_non_eos", 0, (160, 160), 140), "1 <= tau_k"),
        (pair("tau_zero", 5, (60, 70), 60), "tau_zero: pl = 0"),
        (pair("tau_zero", 0, (60, 70), 70), "branch 0 is the Stage-1 root"),
        (pair("midpoint_fallback", 80, (80, 90), 80), "1 <= pl < l0"),
        (pair("midpoint_fallback", 40, (80, 90), 90), "branch 0 is the Stage-1 root"),
        (pair("early_eos_gt104", 50, (104, 90), 104), "l0 > 104"),
        (pair("causal_non_eos", 100, (613, 200), 160), "0 <= L_b - pl_b <= cap - pl_b"),
        (pair("causal_non_eos", 100, (99, 200), 160), "0 <= L_b - pl_b <= cap - pl_b"),
        (pair("causal_non_eos", 100, (200, 200), 513), "\\|p\\^\\(k\\)\\| <= max_new_tokens"),
    ],
)
def test_pair_layouts_that_break_a_law_are_refused(pair, law):
    continued = {
        "causal_non_eos": (0, 1),
        "tau_zero": (1,),
        "midpoint_fallback": (1,),
        "early_eos_gt104": (1,),
        "terminal_dup": (),
    }[pair.category]
    stage2_gen = sum(pair.lengths[b] - pair.prefix_len for b in continued)
    violates(tree_record([pair], [0.0, 1.0], prompt_len=10, stage2_gen=stage2_gen), law)


def test_terminal_dup_leaves_are_one_sequence_with_one_reward():
    violates(
        tree_record(
            [pair("terminal_dup", 40, (40, 40), 40)], [1.0, 0.0], prompt_len=10, stage2_gen=0
        ),
        "one sequence, one reward",
    )


@pytest.mark.parametrize(
    "change,law",
    [
        (dict(stage2_gen=972), "stage2_gen = sum over continued branches"),
        (dict(gen=1474), "gen = sum"),
        (dict(pref=1241), "pref = K L_p"),
        (dict(pad_pref=1240), "pad_pref"),
        (dict(untrim_gen=3111), "untrim_gen"),
        (dict(leaf=1792), "leaf = sum of leaf lengths"),
        (dict(bwd_out=0), "bwd_out"),
        (dict(bwd_full=1793), "bwd_full"),
        (dict(homogeneous=True), "homogeneous"),
        (dict(stage1_lengths=[160, 140, 40]), "one Stage-1 root per pair"),
        (dict(rewards=[1.0] * 8), "pair rewards = rewards"),
        (dict(peak_kv_blocks=-1), "peak_kv_blocks is an integer >= 0"),
        (dict(prefill_run=None), "prefill_run is an integer >= 0"),
    ],
)
def test_tampered_tree_fields_are_refused(change, law):
    violates(dataclasses.replace(stopped_tree_step(), **change), law)


def test_categories_stay_on_their_side():
    record = stopped_tree_step()
    record.pairs[0][6] = "flat"
    violates(record, "tree categories only")
    flat = flat_step_record(
        step=0,
        question_id="q",
        rewards=[1.0, 0.0],
        sigma_r=0.7,
        active=True,
        optimizer_step=True,
        prompt_len=3,
        lengths=[2, 1],
        executed=EngineCounters(decode_rows=1),
        max_new_tokens=8,
        params=1,
        loss=0.0,
        grad_norm=0.0,
        seconds={},
    )
    flat.pairs[0][6] = "tau_zero"
    violates(flat, "one flat category")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(pairs=[]), "at least one pair"),
        (dict(rewards=[1.0, 0.0]), "one reward per leaf"),
        (dict(pairs=[pair("stopped", 1, (2, 2), 1)] * 4), "unknown tree category 'stopped'"),
        (dict(pairs=[pair("terminal_dup", 1, (1, 1, 1), 1)] * 4), "a pair has 2 leaves"),
    ],
)
def test_tree_builder_refuses_malformed_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stopped_tree_step(**kwargs)


def test_flat_builder_refuses_a_tree_category():
    with pytest.raises(ValueError, match="a flat step's category must be flat or flat_warmup"):
        flat_step_record(
            step=0,
            question_id="q",
            rewards=[1.0, 0.0],
            sigma_r=0.7,
            active=True,
            optimizer_step=True,
            prompt_len=3,
            lengths=[2, 1],
            executed=EngineCounters(decode_rows=1),
            max_new_tokens=8,
            params=1,
            loss=0.0,
            grad_norm=0.0,
            seconds={},
            category="tau_zero",
        )


def flat_question(question_id, rewards, lengths, *, prompt_len=20, optimizer_step=True):
    active = len(set(rewards)) > 1
    return flat_step_record(
        **dict(
            COMMON,
            question_id=question_id,
            rewards=rewards,
            sigma_r=0.5 if active else 0.0,
            active=active,
            optimizer_step=optimizer_step,
            prompt_len=prompt_len,
            lengths=lengths,
            seconds={},
            loss=0.1 if active else None,
            grad_norm=2.0 if active else None,
        )
    )


def multi_question_step(questions, **overrides):
    fields = dict(
        step=7,
        questions=questions,
        active=any(q.active for q in questions),
        optimizer_step=True,
        loss=0.2,
        grad_norm=0.7,
        seconds={"rollout": 1.0},
        executed=EngineCounters(decode_rows=sum(n - 1 for q in questions for n in q.lengths)),
    )
    fields.update(overrides)
    return multi_question_step_record(**fields)


def test_a_multi_question_step_sums_its_questions_and_reads_back():
    questions = [
        flat_question("a", [1.0, 0.0], [10, 30]),
        flat_question("b", [0.0, 0.0], [5, 7]),
        flat_question("c", [1.0, 1.0], [12, 12], prompt_len=9),
    ]
    record = multi_question_step(questions)
    check_conservation(record)
    assert record.zero_var_questions == 2 and record.active and not record.homogeneous
    assert record.gen == record.leaf == 40 + 12 + 24
    assert record.bwd_out == 40 and record.bwd_full == 2 * 20 + 40  # question a alone
    assert record.pref == 2 * 20 + 2 * 20 + 2 * 9
    assert record.flops_full == (2 * (record.pref + record.gen) + 6 * record.bwd_full) * PARAMS
    line = json.loads(json.dumps(record.to_json()))
    assert line["questions"][0]["flops_out"] == questions[0].flops_out
    again = read_record(line)
    assert isinstance(again, MultiQuestionRecord) and again == record
    assert isinstance(read_record(questions[0].to_json()), FlatRecord)


def test_every_homogeneous_question_makes_a_zero_gradient_step():
    questions = [flat_question("a", [1.0, 1.0], [10, 30]), flat_question("b", [0.0, 0.0], [5, 7])]
    record = multi_question_step(questions, loss=None, grad_norm=None)
    check_conservation(record)
    assert record.homogeneous and not record.active and record.bwd_out == record.bwd_full == 0


@pytest.mark.parametrize(
    "break_it,law",
    [
        (lambda r: setattr(r, "gen", r.gen + 1), "gen = sum over questions"),
        (lambda r: setattr(r, "zero_var_questions", 0), "counts the homogeneous questions"),
        (lambda r: setattr(r, "active", False), "active iff a question is"),
        (lambda r: setattr(r.questions[1], "optimizer_step", False), "share the step's optimizer"),
        (lambda r: setattr(r.questions[0], "step", 6), "belong to the step"),
        (lambda r: setattr(r, "decode_rows", r.decode_rows + 1), "decode work"),
        (lambda r: setattr(r.questions[1], "leaf", 99), "question b: ledger step 7: leaf = sum"),
        (lambda r: setattr(r, "questions", r.questions[:1]), "at least 2 questions"),
    ],
)
def test_multi_question_laws_name_what_broke(break_it, law):
    record = multi_question_step(
        [flat_question("a", [1.0, 0.0], [10, 30]), flat_question("b", [0.0, 0.0], [5, 7])]
    )
    break_it(record)
    with pytest.raises(LedgerError, match=law):
        check_conservation(record)


def test_a_homogeneous_question_that_ran_backward_breaks_the_laws():
    questions = [flat_question("a", [1.0, 0.0], [10, 30]), flat_question("b", [0.0, 0.0], [5, 7])]
    questions[1] = dataclasses.replace(questions[1], active=True, bwd_out=12, bwd_full=52)
    with pytest.raises(LedgerError, match="backward pass iff its rewards vary"):
        check_conservation(multi_question_step(questions))
