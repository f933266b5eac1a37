"""rlvr-fast verify / compare / report / sweep on tiny runs of the embedded model: verify passes
what the trainer wrote and names the step, field, recorded and re-derived value of any edit;
compare's tables match the eval files and refuse runs that do not pair; report draws its figures;
sweep skips finished runs and resumes an interrupted one."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil

import pytest

from rlvr_fast.analysis.compare import BASE_LABEL, compare_paths
from rlvr_fast.analysis.sweep import plan_sweep, run_sweep
from rlvr_fast.utils.locks import LOCK_NAME
from rlvr_fast.analysis.tables import mean_sd_cell
from rlvr_fast.cli.main import main
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import TrainConfig

SHORT = dict(steps=3, max_new_tokens=48, eval_max_new_tokens=48, lr=1e-4)
TREE_SHORT = dict(SHORT, t_min=8, t_max=16, bifurcate_after_active=0)
EVAL_SETS = {"t": synthetic_problems("test", 8)}
TRAIN = synthetic_problems("train", 3)


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory):
    """A finished 2 arms x 2 seeds sweep (baseline is the reference)."""
    out = tmp_path_factory.mktemp("sweep")
    plan = plan_sweep(["baseline", "ra_flat"], [1, 2], out, **SHORT)
    run_sweep(plan, out, TRAIN, EVAL_SETS, lambda: load_policy("tiny"), progress=False)
    return out


@pytest.fixture(scope="session")
def tree_run(tmp_path_factory):
    """A root_restart run whose every step is a tree (tau_zero pairs on early EOS)."""
    out = tmp_path_factory.mktemp("tree") / "root_restart_s1"
    config = TrainConfig.from_arm("root_restart", seed=1, **TREE_SHORT)
    RLVRTrainer(load_policy("tiny"), config, TRAIN, EVAL_SETS, out_dir=out, progress=False).train()
    return out


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def edited_copy(source, tmp_path, file, edit):
    """A copy of run ``source`` whose ``file`` (JSONL) went through ``edit(lines)``."""
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    lines = read_lines(copy / file)
    edit(lines)
    write_lines(copy / file, lines)
    return copy


# ------------------------------------------------------------------ verify


def test_verify_passes_every_run_the_trainer_wrote(sweep_dir, tree_run, capsys):
    assert main(["verify", str(sweep_dir / "runs"), str(tree_run)]) == 0
    out = capsys.readouterr().out
    assert "verify: 5 of 5 runs PASS" in out
    assert out.count("PASS re-derived: 3 steps equal their re-derivation (24 rewards") == 5
    assert "FAIL" not in out
    assert "tau_zero" in out or "causal_non_eos" in out


def flip(value):
    return 1.0 - value


def rewrite_text_to_flip_reward(lines):
    """Rewrite rollout 0 of step 1 so that re-grading it flips its reward."""
    line = lines[1]
    answer = line["answer"] if line["rewards"][0] == 0 else f"{line['answer']}1"
    line["texts"][0] = f"Adding the numbers step by step, we get \\boxed{{{answer}}}"


EDITS = {
    "one token in a ledger leaf": (
        "ledger.jsonl",
        lambda lines: lines[1]["lengths"].__setitem__(0, lines[1]["lengths"][0] + 1),
        r"step 1 lengths\[0\]: recorded (\d+), re-derived (\d+)",
    ),
    "one token in a rollout": (
        "rollouts.jsonl",
        lambda lines: lines[2]["lengths"].__setitem__(3, lines[2]["lengths"][3] - 1),
        r"step 2 lengths\[3\]: recorded (\d+), re-derived (\d+)",
    ),
    "a changed FLOP figure": (
        "ledger.jsonl",
        lambda lines: lines[0].update(flops_full=lines[0]["flops_full"] + 886144),
        r"step 0 flops_full: recorded (\d+), re-derived (\d+)",
    ),
    "a flipped reward": (
        "ledger.jsonl",
        lambda lines: lines[2]["rewards"].__setitem__(5, flip(lines[2]["rewards"][5])),
        r"step 2 rewards\[5\]: recorded ([\d.]+), re-derived ([\d.]+)",
    ),
    "an edited response": (
        "rollouts.jsonl",
        rewrite_text_to_flip_reward,
        r"step 1 rewards\[0\]: recorded ([\d.]+), re-derived ([\d.]+)",
    ),
    "a flipped grade": (
        "evals/t.jsonl",
        lambda lines: lines[4].update(correct=not lines[4]["correct"]),
        r"evals/t.jsonl:5 item \S+ correct: recorded (\w+), re-graded (\w+)",
    ),
    "a missing step": (
        "ledger.jsonl",
        lambda lines: lines.pop(1),
        r"ledger.jsonl line 2: step (2), expected (1)",
    ),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_verify_names_the_step_field_and_both_values_of_an_edit(sweep_dir, tmp_path, capsys, name):
    file, edit, pattern = EDITS[name]
    run = edited_copy(sweep_dir / "runs" / "baseline_s1", tmp_path, file, edit)
    assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    match = re.search(pattern, out)
    assert match, out
    assert match.group(1) != match.group(2)
    assert f"FAIL: {run}" in out


def test_verify_catches_an_edited_stage1_length_on_a_tree_step(tree_run, tmp_path, capsys):
    def edit(lines):
        lines[0]["stage1_lengths"][0] += 1

    run = edited_copy(tree_run, tmp_path, "rollouts.jsonl", edit)
    assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"step 0 stage1_lengths\[0\]: recorded \d+, re-derived \d+", out), out
    assert re.search(r"step 0 gen: recorded \d+, re-derived \d+", out)


def test_verify_regrades_a_parallel_path_step(tmp_path, capsys):
    """shapley_vote: a path rewritten to box the right answer changes its grade, the vote's
    r_out, U(P) and the exact Shapley values, each named with both values."""
    run = tmp_path / "shapley_vote_s1"
    config = TrainConfig.from_arm("shapley_vote", seed=1, **SHORT)
    RLVRTrainer(load_policy("tiny"), config, TRAIN[:1], out_dir=run, progress=False).train()
    assert main(["verify", str(run)]) == 0

    def box_the_answer_in_a_wrong_path(lines):
        line = lines[0]
        wrong = line["parallel"]["path_correct"].index(False)
        line["texts"][wrong] = (
            f"Adding the numbers step by step, we get \\boxed{{{line['answer']}}}"
        )

    edited = edited_copy(run, tmp_path / "edited", "rollouts.jsonl", box_the_answer_in_a_wrong_path)
    capsys.readouterr()
    assert main(["verify", str(edited)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"step 0 parallel\.phi\[\d+\]: recorded [\d.e-]+, re-derived [\d.e-]+", out), (
        out
    )


def test_verify_fails_a_run_without_recorded_versions(sweep_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sweep_dir / "runs" / "ra_flat_s2", run)
    meta = json.loads((run / "config.json").read_text())
    del meta["versions"]["torch"]
    (run / "config.json").write_text(json.dumps(meta))
    assert main(["verify", str(run)]) == 1
    assert (
        "FAIL config: 1 problem(s)\n    config.json: version of torch not recorded"
        in capsys.readouterr().out
    )


def test_verify_of_something_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlvr-fast: error:") and err.count("\n") == 1 and "no such" in err
    assert main(["verify", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


# ------------------------------------------------------------------ compare


def accuracy(run_dir):
    items = read_lines(run_dir / "evals" / "t.jsonl")
    return sum(item["correct"] for item in items) / len(items)


def test_compare_tables_match_the_eval_files(sweep_dir):
    runs = sweep_dir / "runs"
    comparison = compare_paths([runs])
    assert [arm.arm for arm in comparison.arms] == ["baseline", "ra_flat"]
    assert comparison.reference == "baseline" and comparison.eval_sets == {"t": 8}
    ra = comparison.arms[1]
    assert ra.seeds == [1, 2]
    assert ra.per_seed("t", lambda g: g.accuracy) == [
        accuracy(runs / "ra_flat_s1"),
        accuracy(runs / "ra_flat_s2"),
    ]
    ledger = read_lines(runs / "ra_flat_s2" / "ledger.jsonl")
    assert ra.totals[2]["bwd_full"] == sum(line["bwd_full"] for line in ledger)
    (contrast,) = [c for c in comparison.contrasts if c.metric == "accuracy"]
    assert contrast.arm == "ra_flat" and contrast.seeds == [1, 2]
    assert contrast.per_seed == pytest.approx(
        [accuracy(runs / f"ra_flat_s{s}") - accuracy(runs / f"baseline_s{s}") for s in (1, 2)]
    )
    assert contrast.mean == pytest.approx(sum(contrast.per_seed) / 2)
    for low, high in (contrast.two_level_ci, contrast.pooled_ci):
        assert -1 <= low <= high <= 1
    assert comparison.base.arm == BASE_LABEL and comparison.base.seeds == [1]


def test_compare_reproduces_the_studys_layout(sweep_dir, capsys):
    assert main(["compare", str(sweep_dir / "runs")]) == 0
    table = capsys.readouterr().out
    header = table.splitlines()[0]
    assert header.startswith("| Arm (seeds = 1, 2) | t (8) Mean ± SD (1 / 2) | t AllCap48 (1 / 2)")
    assert "Tokens k (gen [untrim] / pref [pad] / bwd_out / bwd_full)" in header
    assert "Compute (Out / Full / PadFull TFLOPs, step s)" in header
    row = next(line for line in table.splitlines() if line.startswith("| ra_flat |"))
    assert re.search(r"\| \d+\.\d\d% ± \d+\.\d\d% \(\d+\.\d / \d+\.\d\) \|", row), row
    assert re.search(r"\| [\d.]+ \[[\d.]+\] / [\d.]+ \[[\d.]+\] / [\d.]+ / [\d.]+k \|", row)
    assert re.search(r"\| \d+\.\d\d% \(\d/8\) \|", table), "base model row: one value, count/N"
    contrast = next(line for line in table.splitlines() if "ra_flat vs. baseline: accuracy" in line)
    assert re.search(
        r"\[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] pp \| \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] pp \|$", contrast
    ), contrast
    assert mean_sd_cell([44.4, 45.0, 48.8], "%") == "46.07% ± 2.39% (44.4 / 45.0 / 48.8)"


def test_compare_csv_and_json_hold_the_same_numbers(sweep_dir, capsys):
    runs = str(sweep_dir / "runs")
    assert main(["compare", runs, "--format", "json", "--reference", "ra_flat"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reference"] == "ra_flat"
    assert main(["compare", runs, "--format", "csv", "--reference", "ra_flat"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == len(data["records"])
    for row, record in zip(rows, data["records"]):
        assert row["table"] == record["table"] and row["arm"] == record["arm"]
    contrast = next(r for r in data["records"] if r["table"] == "contrasts")
    assert contrast["arm"] == "baseline" and contrast["reference"] == "ra_flat"
    assert len(contrast["diff_per_seed"]) == 2
    assert (sweep_dir / "compare.json").is_file() and (sweep_dir / "compare.csv").is_file()


@pytest.mark.parametrize(
    "change,message",
    [
        ("rename", "mixed eval sets"),
        ("drop_item", "unequal item lists"),
        ("duplicate", "two runs of arm ra_flat with seed 1"),
        ("other_lr", "runs of arm ra_flat differ in lr (0.0001 in"),
        ("unfinished", "unfinished run (no summary.json)"),
    ],
)
def test_compare_refuses_runs_that_do_not_pair(sweep_dir, tmp_path, capsys, change, message):
    copy = tmp_path / "ra_flat_copy"
    shutil.copytree(sweep_dir / "runs" / "ra_flat_s1", copy)
    if change != "duplicate":
        meta = json.loads((copy / "config.json").read_text())
        meta["config"].update(seed=3, lr=1e-5 if change == "other_lr" else 1e-4)
        (copy / "config.json").write_text(json.dumps(meta))
    if change == "unfinished":
        (copy / "summary.json").unlink()
    if change == "rename":
        (copy / "evals" / "t.jsonl").rename(copy / "evals" / "u.jsonl")
    elif change == "drop_item":
        write_lines(copy / "evals" / "t.jsonl", read_lines(copy / "evals" / "t.jsonl")[1:])
    runs = [str(sweep_dir / "runs" / "baseline_s1"), str(sweep_dir / "runs" / "ra_flat_s1")]
    # The edited copy fails verify: refused as such, or (--allow-unverified) marked and then
    # refused by the pairing check under test.
    assert main(["compare", *runs, str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlvr-fast: error:") and err.count("\n") == 1
    assert (message if change == "duplicate" else f"{copy}: fails verify") in err
    assert main(["compare", *runs, str(copy), "--allow-unverified"]) == 2
    *warnings, error = capsys.readouterr().err.splitlines()
    marked = f"rlvr-fast: warning: included unverified: {copy}: fails verify"
    assert len(warnings) == (change != "duplicate")
    assert all(line.startswith(marked) for line in warnings)
    assert error.startswith("rlvr-fast: error:") and message in error
    out = tmp_path / "report"
    assert main(["report", *runs, str(copy), "--out", str(out), "--allow-unverified"]) == 2
    assert not out.exists(), "bad input leaves no half-written report"


# ------------------------------------------------------------------ report


def test_report_draws_every_figure_beside_the_tables(sweep_dir, tree_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", str(sweep_dir / "runs"), str(tree_run), "--out", str(out)]) == 0
    figures = [
        "base_lengths_t.png",
        "accuracy.png",
        "training_over_steps.png",
        "reward_over_steps.png",
        "length_over_steps.png",
        "compute.png",
        "tree_pairs.png",
    ]
    for name in figures:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    for name in figures:
        assert f"]({name})" in report
    assert "| Arm (seeds)" in report and "root_restart (1)" in report
    assert "`rlvr-fast verify`: 5 of 5 runs PASS" in report
    assert sorted(p.name for p in out.iterdir()) == sorted(figures + ["report.md", LOCK_NAME])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report")], "staging removed"


def test_report_and_compare_read_runs_without_evaluations(tmp_path, capsys):
    runs = tmp_path / "runs"
    for arm in ("baseline", "ra_flat"):
        config = TrainConfig.from_arm(arm, seed=1, **SHORT)
        RLVRTrainer(load_policy("tiny"), config, TRAIN, out_dir=runs / arm, progress=False).train()
    out = tmp_path / "report"
    assert main(["report", str(runs), "--out", str(out)]) == 0
    figures = ["training_over_steps.png", "reward_over_steps.png", "length_over_steps.png"]
    for name in [*figures, "compute.png"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    assert "No evaluations saved: the figures and tables are the ledgers'." in report
    assert "accuracy.png" not in report and not (out / "accuracy.png").exists()
    assert main(["compare", str(runs)]) == 0
    table = capsys.readouterr().out
    assert "| baseline |" in table and "Compute (Out / Full / PadFull TFLOPs" in table
    # Some runs evaluated and others not do not compare.
    evaluated = tmp_path / "evaluated"
    config = TrainConfig.from_arm("ra_flat", seed=2, **SHORT)
    RLVRTrainer(
        load_policy("tiny"), config, TRAIN, EVAL_SETS, out_dir=evaluated, progress=False
    ).train()
    assert main(["compare", str(runs / "baseline"), str(evaluated)]) == 2
    assert "mixed eval sets: " in capsys.readouterr().err


def test_sweep_wrote_compare_and_report(sweep_dir):
    assert (sweep_dir / "compare.md").read_text().startswith("| Arm (seeds = 1, 2)")
    assert (sweep_dir / "report" / "report.md").is_file()
    assert "tree_pairs.png" not in (sweep_dir / "report" / "report.md").read_text()


# ------------------------------------------------------------------ sweep


class Killed(Exception):
    pass


def test_sweep_skips_finished_runs_and_resumes_an_interrupted_one(tmp_path, monkeypatch):
    settings = dict(SHORT, checkpoint_every=1)
    plan = plan_sweep(["zg_flat"], [1, 2], tmp_path, **settings)
    train_step = RLVRTrainer.step_on

    def killed_at_seed_2_step_2(trainer, step, problems):
        if trainer.config.seed == 2 and step == 2:
            trainer.close()
            raise Killed
        return train_step(trainer, step, problems)

    monkeypatch.setattr(RLVRTrainer, "step_on", killed_at_seed_2_step_2)
    with pytest.raises(Killed):
        run_sweep(plan, tmp_path, TRAIN, EVAL_SETS, lambda: load_policy("tiny"), progress=False)
    finished, interrupted = (run.path for run in plan)
    assert (finished / "summary.json").is_file() and not (interrupted / "summary.json").exists()
    assert len(read_lines(interrupted / "ledger.jsonl")) == 2
    finished_mtime = (finished / "summary.json").stat().st_mtime_ns
    before_kill = read_lines(interrupted / "ledger.jsonl")

    monkeypatch.setattr(RLVRTrainer, "step_on", train_step)
    tables = run_sweep(
        plan_sweep(["zg_flat"], [1, 2], tmp_path, **settings),
        tmp_path,
        TRAIN,
        EVAL_SETS,
        lambda: load_policy("tiny"),
        progress=False,
    )
    assert (finished / "summary.json").stat().st_mtime_ns == finished_mtime, "finished: skipped"
    resumed = read_lines(interrupted / "ledger.jsonl")
    assert [line["step"] for line in resumed] == [0, 1, 2]
    # Steps 0 and 1 were not run again: their lines keep the timings of the first attempt.
    assert resumed[:2] == before_kill
    assert "| zg_flat |" in tables
    assert main(["verify", str(tmp_path / "runs")]) == 0


def test_a_sweep_refuses_a_run_directory_with_other_settings(sweep_dir, tmp_path, capsys):
    same_settings = [
        "--set",
        "max_new_tokens=48",
        "--set",
        "eval_max_new_tokens=48",
        "--set",
        "lr=1e-4",
    ]
    assert (
        main(
            [
                "sweep",
                "--arms",
                "baseline",
                "--seeds",
                "1",
                "--steps",
                "4",
                *same_settings,
                "--out",
                str(sweep_dir),
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "baseline_s1 was trained with steps=3, this sweep asks for steps=4" in err
    for args, message in (
        (["--arms", "nope"], "unknown arm 'nope'"),
        (["--arms", "baseline", "--seeds", "1,x"], "--seeds wants"),
        (["--arms", "baseline,baseline"], "listed twice"),
    ):
        out = tmp_path / "new"
        assert main(["sweep", *args, "--out", str(out), "--quiet"]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


def test_compare_and_report_read_the_ablation_arms(sweep_dir, tmp_path, capsys):
    """A multi-question run (one ledger line per step, a sub-record per question) and a Polyak
    run (evals/polyak/ beside evals/) verify, compare and report beside the flat arms."""
    runs = []
    for arm, settings in (
        ("accum4", TREE_SHORT),
        ("ra_mst_tail50", dict(TREE_SHORT, polyak_start=2)),
    ):
        runs.append(tmp_path / "runs" / f"{arm}_s1")
        config = TrainConfig.from_arm(arm, seed=1, **settings)
        RLVRTrainer(
            load_policy("tiny"), config, TRAIN, EVAL_SETS, out_dir=runs[-1], progress=False
        ).train()
    assert (runs[1] / "evals" / "polyak" / "t.jsonl").is_file()
    assert main(["verify", *map(str, runs)]) == 0
    assert "verify: 2 of 2 runs PASS" in capsys.readouterr().out
    assert main(["compare", str(sweep_dir / "runs"), *map(str, runs), "--format", "json"]) == 0
    arms = [record["arm"] for record in json.loads(capsys.readouterr().out)["records"]]
    assert {"accum4", "ra_mst_tail50"} <= set(arms)
    assert (
        main(
            ["report", str(sweep_dir / "runs"), *map(str, runs), "--out", str(tmp_path / "report")]
        )
        == 0
    )
    assert (tmp_path / "report" / "tree_pairs.png").is_file()
