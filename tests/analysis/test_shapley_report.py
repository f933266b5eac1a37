"""The falsifier diagnostic: on a constructed run whose phi and deltas are known by hand, on a
real summary-aggregator run (summaries regenerated), and through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rlvr_fast.cli.main import main
from rlvr_fast.data.problems import Problem
from rlvr_fast.models.policy import load_policy
from rlvr_fast.credit.shapley import MajorityVote, PassAtK
from rlvr_fast.analysis.shapley_report import (
    bootstrap_spearman,
    build_report,
    rankdata,
    shapley_report,
    spearman,
    vote_deltas,
)
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig

# Response 0: paths [right, right, wrong] credited by vote Shapley, phi = (7/12, 7/12, -1/6);
# masking a right path leaves a two-way tie (1/2), masking the wrong one changes nothing:
# delta = (1/2, 1/2, 0). Response 1: [right, wrong, wrong'] credited by pass@|S| Shapley,
# phi = (1, 0, 0), sum 1, while its vote is a three-way tie, r_out = 1/3; masking path 0 leaves
# no right answer (delta 1/3), masking a wrong one a two-way tie (delta 1/3 - 1/2 = -1/6).
PHI = [7 / 12, 7 / 12, -1 / 6, 1.0, 0.0, 0.0]
DELTA = [1 / 2, 1 / 2, 0.0, 1 / 3, -1 / 6, -1 / 6]
# Ranks by hand (ties averaged): phi -1/6 < 0 = 0 < 7/12 = 7/12 < 1; delta -1/6 = -1/6 < 0 < 1/3 < 1/2 = 1/2.
PHI_RANKS = [4.5, 4.5, 1, 6, 2.5, 2.5]
DELTA_RANKS = [5.5, 5.5, 3, 4, 1.5, 1.5]


def constructed_run(directory, steps: int = 1):
    answers = ["4", "4", "5", "4", "5", "6"]
    correct = [True, True, False, True, False, False]
    tables = [
        MajorityVote(answers[:3], correct[:3]).values(np.arange(8)).tolist(),
        PassAtK(correct[3:]).values(np.arange(8)).tolist(),
    ]
    config = {
        "arm": "constructed",
        "aggregator": "vote",
        "path_utility": "vote",
        "path_credit": "shapley",
        "num_paths": 3,
        "shapley_permutations": 0,
        "shapley_antithetic": True,
    }
    (directory / "config.json").write_text(json.dumps({"config": config}))
    line = {
        "texts": [""] * 6,
        "parallel": {
            "paths_per_response": 3,
            "path_answers": answers,
            "path_correct": correct,
            "phi": PHI,
            "phi_se": [0.0] * 6,
            "r_out": [1.0, 1 / 3],
            "utility_full": [1.0, 1.0],
            "utility_empty": [0.0, 0.0],
            "utility_tables": tables,
        },
    }
    with open(directory / "rollouts.jsonl", "w") as file:
        for step in range(steps):
            file.write(json.dumps(dict(line, step=step)) + "\n")
    return directory


def test_vote_deltas_by_hand():
    assert vote_deltas(["4", "4", "5"], [True, True, False]) == [0.5, 0.5, 0.0]
    np.testing.assert_allclose(
        vote_deltas(["4", "5", "6"], [True, False, False]), [1 / 3, -1 / 6, -1 / 6]
    )


def test_ranks_and_spearman():
    np.testing.assert_array_equal(rankdata(np.array(PHI)), PHI_RANKS)
    np.testing.assert_array_equal(rankdata(np.array(DELTA)), DELTA_RANKS)
    assert spearman(PHI, DELTA) == pytest.approx(np.corrcoef(PHI_RANKS, DELTA_RANKS)[0, 1])
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_constructed_game_report(tmp_path):
    report, responses = build_report(constructed_run(tmp_path), resamples=200, mc_repeats=50)
    assert [r.delta for r in responses] == [DELTA[:3], pytest.approx(DELTA[3:])]
    assert report["spearman_phi_delta"] == pytest.approx(np.corrcoef(PHI_RANKS, DELTA_RANKS)[0, 1])
    assert report["mean_abs_sum_phi_minus_r_out"] == pytest.approx((0 + 2 / 3) / 2)
    assert report["mean_abs_sum_phi_minus_utility"] == pytest.approx(0.0, abs=1e-12)
    assert report["mean_abs_utility_minus_r_out"] == pytest.approx((0 + 2 / 3) / 2)
    assert (report["paths"], report["responses"], report["steps"]) == (6, 2, 1)
    assert report["mc_permutations"] == 5 and report["mc_standard_error"] > 0
    # Two responses: resampling them gives the full pair, or one response twice.
    low, high = report["spearman_ci95"]
    assert low <= report["spearman_phi_delta"] <= high


def test_bootstrap_interval_narrows_with_more_responses(tmp_path):
    (tmp_path / "few").mkdir()
    (tmp_path / "many").mkdir()
    few, _ = build_report(constructed_run(tmp_path / "few", steps=2), resamples=400, mc_repeats=2)
    many, responses = build_report(
        constructed_run(tmp_path / "many", steps=40), resamples=400, mc_repeats=2
    )
    assert many["spearman_phi_delta"] == pytest.approx(few["spearman_phi_delta"])
    assert np.diff(many["spearman_ci95"]) < np.diff(few["spearman_ci95"])
    assert bootstrap_spearman(responses[:1], 10, seed=0) == bootstrap_spearman(
        responses[:1], 10, seed=1
    )


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    constructed_run(tmp_path)
    assert main(["shapley-report", str(tmp_path), "--resamples", "50"]) == 0
    table = capsys.readouterr().out
    assert "Spearman(phi_j, delta_j)" in table and "mean abs(sum phi - r_out) | 0.3333" in table
    out = tmp_path / "shapley_report"
    assert json.loads((out / "report.json").read_text())["paths"] == 6
    assert (out / "report.md").read_text() == table
    assert (out / "scatter.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "prepare,message",
    [
        (lambda d: None, "config.json: no such file"),
        (
            lambda d: constructed_run(d).joinpath("rollouts.jsonl").write_text('{"step": 0}\n'),
            "no parallel-path steps",
        ),
    ],
)
def test_cli_errors_exit_2_with_one_line(tmp_path, capsys, prepare, message):
    prepare(tmp_path)
    assert main(["shapley-report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert main(["shapley-report", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_summary_runs_regenerate_the_summaries(tmp_path):
    problem = Problem(id="easy", question="What is 12 * 3?", answer="36", source="test")
    config = TrainConfig.from_arm(
        "shapley_summary",
        steps=2,
        max_new_tokens=32,
        group_size=2,
        num_paths=2,
        gate_min_chars=None,
        lr=1e-4,
    )
    RLVRTrainer(load_policy("tiny"), config, [problem], out_dir=tmp_path, progress=False).train()
    report = shapley_report(tmp_path, max_steps=1, resamples=20)
    assert (report["steps"], report["responses"], report["paths"]) == (1, 2, 4)
    assert (tmp_path / "shapley_report" / "scatter.png").is_file()
    assert report["mean_abs_sum_phi_minus_utility"] == pytest.approx(0.0, abs=1e-12)
    _, responses = build_report(tmp_path, resamples=1, mc_repeats=1)
    assert all(d in (-1.0, 0.0, 1.0) for r in responses for d in r.delta)
