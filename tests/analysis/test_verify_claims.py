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
