"""The ledger's registry of step kinds' records (``rlvr_fast.ledger.records.register_record``):
each kind's record holds its own fields and laws, lines keep the key order ledgers were written
in (the golden hashes sort keys, so this is where the bytes are held), and a line reads back as
the record whose fields it sets."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from rlvr_fast.engine import EngineCounters
from rlvr_fast.ledger import records
from rlvr_fast.ledger.laws import check_conservation
from rlvr_fast.ledger.records import (
    LedgerError,
    StepRecord,
    multi_question_step_record,
    read_record,
    register_record,
)
from rlvr_fast.train.kinds.flat_record import FlatRecord, flat_step_record
from rlvr_fast.train.kinds.parallel_record import ParallelRecord, ParallelStats
from rlvr_fast.train.kinds.tree_record import TreeRecord

# A question's line as every ledger before the records shared a base wrote it (flat steps carry
# the tree and parallel fields as null), then a multi-question line.
QUESTION_KEYS = [
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
    "gen",
    "pref",
    "pad_pref",
    "untrim_gen",
    "leaf",
    "bwd_out",
    "bwd_full",
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
    "stage1_lengths",
    "stage2_gen",
    "parallel",
]
OPTIONAL_KEYS = ["policy", "reused", "trained", "loss_scale"]
FLOPS = ["flops_out", "flops_full", "flops_pad_full"]
MULTI_KEYS = [
    "step",
    "questions",
    "zero_var_questions",
    "homogeneous",
    "active",
    "optimizer_step",
    *QUESTION_KEYS[10:27],
    "policy",
    "loss_scale",
    *FLOPS,
]


def flat(question_id="q", rewards=(1.0, 0.0), lengths=(3, 5), **extra) -> FlatRecord:
    active = len(set(rewards)) > 1
    return flat_step_record(
        step=2,
        question_id=question_id,
        rewards=list(rewards),
        sigma_r=0.5 if active else 0.0,
        active=active,
        optimizer_step=True,
        prompt_len=4,
        lengths=list(lengths),
        executed=EngineCounters(decode_rows=sum(n - 1 for n in lengths)),
        max_new_tokens=8,
        params=10,
        loss=0.5,
        grad_norm=1.0,
        seconds={"rollout": 1.0},
        **extra,
    )


def test_a_flat_line_keeps_the_key_order_of_old_ledgers():
    assert list(flat().to_json()) == QUESTION_KEYS + FLOPS
    record = flat(trained=[1], reused=True)
    record.policy, record.loss_scale = {"entropy": 1.0}, {"scale": 2.0, "skipped": False}
    assert list(record.to_json()) == QUESTION_KEYS + OPTIONAL_KEYS + FLOPS


def test_tree_and_parallel_lines_set_their_fields_in_place():
    fields = {f: getattr(flat(), f) for f in QUESTION_KEYS[:27] if f != "seconds"}
    tree = TreeRecord(**fields, stage1_lengths=[3], stage2_gen=5)
    assert list(tree.to_json()) == QUESTION_KEYS + FLOPS
    assert tree.to_json()["stage1_lengths"] == [3] and tree.to_json()["parallel"] is None
    stats = ParallelStats(
        1, "vote", "outcome", "shapley", 0, "none", 1.0, 0.0, [], [], [], [], [], 1, [], [], []
    )
    parallel = ParallelRecord(**fields, parallel=stats)
    line = parallel.to_json()
    assert list(line) == QUESTION_KEYS + FLOPS and line["parallel"]["aggregator"] == "vote"
    assert isinstance(read_record(line), ParallelRecord) and read_record(line) == parallel
    assert isinstance(read_record(tree.to_json()), TreeRecord)


def test_a_multi_question_line_keeps_its_key_order():
    questions = [flat("a"), flat("b", rewards=(0.0, 0.0))]
    line = multi_question_step_record(
        step=2,
        questions=questions,
        active=True,
        optimizer_step=True,
        executed=EngineCounters(decode_rows=12),
        loss=0.1,
        grad_norm=1.0,
        seconds={},
    ).to_json()
    assert list(line) == [k for k in MULTI_KEYS if k not in ("policy", "loss_scale")]
    assert list(line["questions"][0]) == QUESTION_KEYS + FLOPS


@pytest.fixture
def registry(monkeypatch):
    """The registry as the kinds left it, restored after the test."""
    monkeypatch.setattr(records, "RECORDS", list(records.RECORDS))
    return records.RECORDS


def test_a_kinds_own_record_is_written_read_and_checked_by_its_laws(registry):
    @register_record
    @dataclass(kw_only=True)
    class CoinRecord(FlatRecord):
        coins: list[int]

        def kind_laws(self, require, engine_counts: bool) -> None:
            super().kind_laws(require, engine_counts)
            require(len(self.coins) == len(self.lengths), "one coin per leaf")

    fields = {f: getattr(flat(), f) for f in QUESTION_KEYS[:27]}
    record = CoinRecord(**fields, coins=[0, 1])
    line = json.loads(json.dumps(record.to_json()))
    assert list(line) == QUESTION_KEYS + ["coins"] + FLOPS
    again = read_record(line)
    assert isinstance(again, CoinRecord) and again == record
    check_conservation(again)
    assert record.derived_fields()[-6:] == ("coins", "reused", "trained", *FLOPS)
    again.coins = [1]
    with pytest.raises(LedgerError, match="one coin per leaf"):
        check_conservation(again)
    assert isinstance(read_record(flat().to_json()), FlatRecord)


def test_records_that_cannot_be_told_apart_are_refused(registry):
    with pytest.raises(TypeError, match="not a StepRecord"):
        register_record(dict)
    with pytest.raises(ValueError, match="registered twice"):
        register_record(TreeRecord)

    @dataclass(kw_only=True)
    class Plain(StepRecord):
        pass

    with pytest.raises(ValueError, match="cannot be told apart from FlatRecord"):
        register_record(Plain)

    @dataclass(kw_only=True)
    class Roots(StepRecord):
        stage1_lengths: list[int]

    with pytest.raises(ValueError, match=r"cannot be told apart from TreeRecord"):
        register_record(Roots)


def test_a_line_of_two_kinds_is_refused():
    line = flat().to_json()
    line.update(stage1_lengths=[3], stage2_gen=5, parallel={"paths_per_response": 1})
    with pytest.raises(
        TypeError, match=r"sets fields of (Tree|Parallel)Record and (Tree|Parallel)Record$"
    ):
        read_record(line)


def test_a_question_record_of_no_kind_has_no_laws():
    fields = {f: getattr(flat(), f) for f in QUESTION_KEYS[:27]}
    with pytest.raises(NotImplementedError, match="StepRecord is the record of no step kind"):
        check_conservation(StepRecord(**fields))
