"""verify checks every figure the run directory claims (issue 39, item 3): an edited
config.json, a non-finite loss or grad_norm, an fp16 loss scale off its law, summary.json's
totals and unknown ledger keys each FAIL, where they used to PASS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("claims") / "run"
    config = TrainConfig.from_arm(
        "zg_flat", steps=3, max_new_tokens=8, eval_max_new_tokens=8, precision="fp16-mixed"
    )
    problems = synthetic_problems("train", 3, seed=3)
    RLVRTrainer(load_policy("tiny"), config, problems, {}, out_dir=out, progress=False).train()
    return out


def edit_ledger(run: Path, edit) -> None:
    path = run / "ledger.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    edit(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def edit_json(path: Path, edit) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


EDITS = {
    "lr": (
        lambda run: edit_json(run / "config.json", lambda c: c["config"].update(lr=0.5)),
        "do not hash to the signature's settings_sha256",
    ),
    "signature arm": (
        lambda run: edit_json(run / "config.json", lambda c: c["rlvr_fast_run"].update(arm="x")),
        "signature arm 'x', settings 'zg_flat'",
    ),
    "nan loss": (
        lambda run: edit_ledger(run, lambda lines: lines[1].update(loss=float("nan"))),
        "step 1 loss: nan",
    ),
    "infinite grad_norm": (
        lambda run: edit_ledger(run, lambda lines: lines[0].update(grad_norm=float("inf"))),
        "step 0 grad_norm: inf",
    ),
    "loss scale edited": (
        lambda run: edit_ledger(
            run, lambda lines: lines[2].update(loss_scale={"scale": 1024.0, "skipped": False})
        ),
        "step 2 loss_scale.scale: recorded 1024.0, the law gives 65536.0",
    ),
    "loss scale removed": (
        lambda run: edit_ledger(run, lambda lines: lines[1].pop("loss_scale")),
        "step 1 loss_scale: recorded None",
    ),
    "summary totals": (
        lambda run: edit_json(
            run / "summary.json", lambda s: s["totals_this_run"].update(gen=10**6)
        ),
        "summary.json totals_this_run.gen: 1000000",
    ),
    "unknown key": (
        lambda run: edit_ledger(run, lambda lines: lines[0].update(surprise=1)),
        "step 0: unknown key(s) surprise",
    ),
}


def test_the_untouched_run_passes(fp16_run):
    assert verify_run(fp16_run).ok, verify_run(fp16_run).lines()


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_figure_fails_verify_naming_it(fp16_run, tmp_path, edit):
    """Regression: each of these edits passed verify."""
    run = tmp_path / "run"
    shutil.copytree(fp16_run, run)
    change, message = EDITS[edit]
    change(run)
    result = verify_run(run)
    assert not result.ok
    assert any(message in line for line in result.lines()), result.lines()


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seeds")
    problems = synthetic_problems("train", 2, seed=3)
    held_out = {"t": synthetic_problems("test", 3, seed=8)}
    for seed in (1, 2):
        config = TrainConfig.from_arm(
            "zg_flat", steps=1, seed=seed, max_new_tokens=8, eval_max_new_tokens=8
        )
        policy = load_policy("tiny")
        out = root / f"s{seed}"
        RLVRTrainer(policy, config, problems, held_out, out_dir=out, progress=False).train()
    return root


def flip_first_correct(run: Path) -> None:
    path = run / "evals" / "t.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines()]
    items[0]["correct"] = not items[0]["correct"]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


def drop_last_ledger_line(run: Path) -> None:
    path = run / "ledger.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))


def other_torch_version(run: Path) -> None:
    edit_json(run / "config.json", lambda meta: meta["versions"].update(torch="0.0.1"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (flip_first_correct, "fails verify (evals: evals/t.jsonl:1"),
        (drop_last_ledger_line, "fails verify (steps:"),
        (other_torch_version, "recorded with rlvr_fast"),
    ],
    ids=["eval item flipped", "ledger line missing", "other versions"],
)
def test_compare_refuses_a_run_verify_would_reject_unless_allowed(
    two_seeds, tmp_path, capsys, damage, message
):
    """Regression: compare pooled an eval item's flipped `correct` (18.75% for 12.5%), a run
    missing a ledger line, and runs recorded under other package versions, exit 0."""
    from rlvr_fast.cli.main import main

    runs = tmp_path / "runs"
    shutil.copytree(two_seeds, runs)
    assert main(["compare", str(runs)]) == 0
    capsys.readouterr()
    damage(runs / "s2")
    assert main(["compare", str(runs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{runs / 's2'}: " in err and message in err, err
    # Included, marked (compare's own checks still refuse a run whose ledger is short).
    status = main(["compare", str(runs), "--allow-unverified"])
    assert status == (2 if damage is drop_last_ledger_line else 0)
    warning = capsys.readouterr().err.splitlines()[0]
    assert warning.startswith(f"rlvr-fast: warning: included unverified: {runs / 's2'}")
