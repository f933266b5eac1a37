"""The golden test's comparison under tolerance (golden_runs.compare_figures) on made-up figures:
what it lets through and what it stops."""

from __future__ import annotations

import copy

from golden_runs import FLOAT_RTOL, compare_figures

RECORDED = {
    "ledger": [
        {"step": s, "gen": 90 + s, "rewards": [0.0, 1.0], "loss": 0.5 + s, "active": True}
        for s in range(3)
    ],
    "rollouts": ["r0", "r1", "r2"],
    "evals": {
        "before/held_out.jsonl": [{"id": "a", "correct": False, "length": 9}],
        "held_out.jsonl": [{"id": "a", "correct": True, "length": 8}],
    },
}


def figures(**changes):
    got = copy.deepcopy(RECORDED)
    for step, field, value in changes.get("ledger", []):
        got["ledger"][step][field] = value
    for step, digest in changes.get("rollouts", []):
        got["rollouts"][step] = digest
    return got


def test_floats_within_the_tolerance_pass_and_beyond_it_fail():
    assert compare_figures(figures(ledger=[(2, "loss", 2.5 * (1 + FLOAT_RTOL / 2))]), RECORDED) == (
        [],
        None,
    )
    problems, _ = compare_figures(
        figures(ledger=[(2, "loss", 2.5 * (1 + 4 * FLOAT_RTOL))]), RECORDED
    )
    assert problems and problems[0].startswith("step 2.loss")


def test_counts_and_flags_are_exact():
    for field, value in (("gen", 91), ("active", False), ("rewards", [1.0, 1.0])):
        problems, _ = compare_figures(figures(ledger=[(0, field, value)]), RECORDED)
        assert problems and problems[0].startswith(f"step 0.{field}"), (field, problems)


def test_later_rollouts_may_part_from_a_near_tie_but_the_first_step_may_not():
    got = figures(rollouts=[(1, "other")], ledger=[(1, "gen", 70), (2, "loss", 9.0)])
    got["evals"]["held_out.jsonl"][0]["correct"] = False
    assert compare_figures(got, RECORDED) == ([], 1), "steps 1-2 and the final eval not compared"
    got["evals"]["before/held_out.jsonl"][0]["length"] = 10
    assert compare_figures(got, RECORDED)[0], "the evaluation before training stays exact"
    problems, diverged = compare_figures(figures(rollouts=[(0, "other")]), RECORDED)
    assert diverged == 0 and problems == ["step 0: rollouts differ from the recorded ones"]


def test_another_number_of_steps_fails():
    got = figures()
    got["ledger"].pop()
    got["rollouts"].pop()
    assert compare_figures(got, RECORDED)[0]
