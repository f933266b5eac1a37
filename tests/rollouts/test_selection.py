"""select-data: pass rates through the engine, exactly the questions in range kept, stratified
order, the rates file (resume, re-selection without sampling, other settings refused), the CLI."""

from __future__ import annotations

import json

import pytest

from rlvr_fast.rollouts import selection as select_module
from rlvr_fast.cli.main import main
from rlvr_fast.data.problems import Problem, load_problems
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import load_policy
from rlvr_fast.rollouts.selection import (
    PassRange,
    SelectionSettings,
    rates_path,
    select_data,
    stratified,
    stratum,
)

SETTINGS = SelectionSettings(model="tiny", k=4, max_new_tokens=40, seed=5)
PROBLEMS = synthetic_problems("train", 10, seed=4)


@pytest.fixture(scope="module")
def tiny():
    policy = load_policy("tiny")
    return policy, RolloutEngine.for_policy(policy, kv_blocks=512)


def run(tiny, out, pass_range=None, **kwargs):
    policy, engine = tiny
    return select_data(
        policy,
        engine,
        PROBLEMS,
        SETTINGS,
        pass_range or PassRange(),
        out,
        progress=False,
        **dict(dict(batch_questions=4), **kwargs),
    )


def test_pass_range_bounds():
    default = PassRange()
    assert 0.25 in default and 0.0 not in default and 1.0 not in default
    assert str(default) == "0 < pass < 1"
    closed = PassRange(0.0, 0.5)
    assert 0.0 in closed and 0.5 in closed and 0.75 not in closed
    with pytest.raises(ValueError, match="--min-pass .* is above --max-pass"):
        PassRange(0.75, 0.25)
    with pytest.raises(ValueError, match=r"--max-pass must be in \[0, 1\]"):
        PassRange(None, 2.0)


def test_stratified_order_is_round_robin_over_sorted_cells():
    def problem(i, subject, level):
        return Problem(
            id=str(i), question="q", answer="1", source="t", level=level, subject=subject
        )

    items = [
        problem(0, "b", 1),
        problem(1, "a", 2),
        problem(2, "b", 1),
        problem(3, "a", 1),
        problem(4, None, 3),
        problem(5, "a", 2),
        problem(6, "b", 1),
    ]
    order = [p.id for p in stratified(items, stratum)]
    # Cells (a,1) [3], (a,2) [1,5], (b,1) [0,2,6], (None,3) [4].
    assert order == ["3", "1", "0", "4", "5", "2", "6"]


def test_select_data_keeps_exactly_the_questions_in_range(tiny, tmp_path):
    out = tmp_path / "zpd.json"
    selection = run(tiny, out, PassRange(0.25, 1.0))
    rates = {r.id: r for r in selection.rates}
    assert len(rates) == len(PROBLEMS) and all(r.samples == 4 for r in rates.values())
    rows = json.loads(out.read_text())
    expected = stratified([p for p in PROBLEMS if rates[p.id].rate >= 0.25], stratum)
    assert [row["id"] for row in rows] == [p.id for p in expected]
    for row in rows:
        assert row["pass_rate"] == rates[row["id"]].passes / 4 == row["passes"] / row["samples"]
    assert [p.id for p in load_problems(out)] == [p.id for p in expected]
    recorded = [json.loads(line) for line in rates_path(out).read_text().splitlines()]
    assert recorded[0]["settings"]["k"] == 4 and len(recorded) == 1 + len(PROBLEMS)


def test_rates_resume_and_reselect_without_sampling(tiny, tmp_path, monkeypatch):
    whole = run(tiny, tmp_path / "whole.jsonl").rates
    calls = []
    sample_groups = select_module.sample_groups

    def dies_on_the_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return sample_groups(*args, **kwargs)

    monkeypatch.setattr(select_module, "sample_groups", dies_on_the_second_batch)
    out = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out)
    assert len(rates_path(out).read_text().splitlines()) == 1 + 4, "the first batch is kept"
    # A different batch size does not change what a question samples.
    assert run(tiny, out, batch_questions=3).rates == whole

    def no_sampling(*args, **kwargs):
        raise AssertionError("every rate is on disk")

    monkeypatch.setattr(select_module, "sample_groups", no_sampling)
    kept = run(tiny, out, PassRange(0.0, 1.0), limit=3).kept
    assert [p.id for p, _ in kept] == [p.id for p in stratified(PROBLEMS, stratum)[:3]]


def test_a_rates_file_of_other_settings_is_refused(tiny, tmp_path):
    out = tmp_path / "zpd.jsonl"
    run(tiny, out)
    policy, engine = tiny
    other = SelectionSettings(model="tiny", k=2, max_new_tokens=40, seed=5)
    with pytest.raises(ValueError, match="measured with other settings"):
        select_data(policy, engine, PROBLEMS, other, PassRange(), out, progress=False)


def test_select_data_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "sel.json"
    assert (
        main(
            [
                "select-data",
                "--data",
                "synthetic:train:6",
                "--k",
                "2",
                "--out",
                str(out),
                "--max-new-tokens",
                "32",
                "--min-pass",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "of 6 questions with 0 <= pass < 1" in printed
    assert len(json.loads(out.read_text())) <= 6
    for args, message in (
        (["--k", "0"], "--k must be in [1, 4096]"),
        (["--min-pass", "0.9", "--max-pass", "0.1"], "is above --max-pass"),
        (["--out", str(tmp_path / "x.csv")], "--out must end in .json"),
    ):
        argv = ["select-data", "--data", "synthetic:train:2", "--out", str(out), *args]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("rlvr-fast: error:") and message in err and "\n" not in err
