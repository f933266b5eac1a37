"""Run directories: --out never overwrites what is not a run, --resume resumes only the run it
was started as, a run stopped at any point resumes to the same bytes, and non-finite training
stops at its step with the last good checkpoint intact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rlvr_fast.data.problems import Problem
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.run.directory import RunDirectoryError, whole_lines
from rlvr_fast.run.state_file import StateFileError, save_state
from rlvr_fast.run import recorder, state_file
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.train import distributed
from rlvr_fast.train.kinds import flat
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.nonfinite import NonFiniteError
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.utils.locks import LOCK_NAME

SETTINGS = dict(max_new_tokens=32, eval_max_new_tokens=32, lr=1e-4, checkpoint_every=2)
PROBLEMS = synthetic_problems("train", 3, seed=3)
EVALS = {"t": synthetic_problems("test", 2, seed=3)}
CHECKPOINT_NAME = RunLayout(Path("run")).checkpoint.name


def trainer(
    out, *, arm="zg_flat", steps=3, resume=False, problems=PROBLEMS, evals=EVALS, **overrides
):
    config = TrainConfig.from_arm(arm, steps=steps, **{**SETTINGS, **overrides})
    return RLVRTrainer(
        load_policy("tiny"), config, problems, evals, out_dir=out, resume=resume, progress=False
    )


def tree_digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def outputs(run) -> dict:
    """What a run leaves that must not depend on where it was stopped: the final weights,
    the ledger without timings, the rollouts, the evaluations."""
    ledger = [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in (run / "ledger.jsonl").read_text().splitlines()
    ]
    return {
        "weights": (run / "final" / "model.safetensors").read_bytes(),
        "ledger": ledger,
        "rollouts": (run / "rollouts.jsonl").read_text(),
        "evals": {p.name: p.read_text() for p in sorted((run / "evals").rglob("*.jsonl"))},
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    trainer(run).train()
    return outputs(run)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished three-step run; tests copy it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    trainer(run).train()
    return run


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_out_refuses_a_model_directory_and_leaves_it_intact(tmp_path):
    """Regression: --out pointing at a model directory overwrote its config.json and weights."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    before = tree_digest(model)
    with pytest.raises(RunDirectoryError, match="not empty and not an rlvr_fast run directory"):
        trainer(model)
    assert tree_digest(model) == before


def test_out_refuses_a_file_and_an_unwritable_directory(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirectoryError, match="exists and is not a directory"):
        trainer(tmp_path / "file")
    with pytest.raises(RunDirectoryError, match="cannot create the run directory"):
        trainer(tmp_path / "file" / "run")
    (tmp_path / "readonly").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(RunDirectoryError, match="not writable"):
        trainer(tmp_path / "readonly")


def test_resume_on_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(RunDirectoryError, match="no such run directory to resume"):
        trainer(tmp_path / "typo", resume=True)
    assert not (tmp_path / "typo").exists()


def test_an_existing_run_needs_resume(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    with pytest.raises(RunDirectoryError, match="already holds a run .use --resume"):
        trainer(run)


OTHER_PROBLEMS = synthetic_problems("train", 3, seed=4)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(arm="ra_flat"), "the run has arm 'zg_flat', this command asks for 'ra_flat'"),
        (dict(seed=7), "the run has seed 42, this command asks for 7"),
        (dict(lr=1e-3), r"other settings \(lr: 0.0001 then, 0.001 now\)"),
        (dict(steps=2), "a resume may extend it, not shorten it to 2"),
        (dict(problems=OTHER_PROBLEMS), "the training problems differ"),
        (dict(evals={"u": EVALS["t"]}), "the evaluation sets differ"),
        (dict(other_weights=True), "the model .weights or tokenizer. differs"),
    ],
)
def test_resume_refuses_another_run_and_writes_nothing(finished, tmp_path, change, message):
    """Regression: --resume with another arm, seed or step count rewrote the config and mixed two
    runs in one ledger."""
    run = copy_of(finished, tmp_path)
    before = tree_digest(run)
    if change.pop("other_weights", False):
        policy = load_policy("tiny")
        with torch.no_grad():
            policy.model.model.norm.weight[0] += 1.0
        config = TrainConfig.from_arm("zg_flat", steps=3, **SETTINGS)
        with pytest.raises(RunDirectoryError, match=message):
            RLVRTrainer(policy, config, PROBLEMS, EVALS, out_dir=run, resume=True, progress=False)
    else:
        with pytest.raises(RunDirectoryError, match=message):
            trainer(run, resume=True, **change)
    assert tree_digest(run) == before


def test_a_finished_run_resumed_is_left_as_it_is(finished, tmp_path):
    """Regression: resuming a finished run truncated a partial last ledger line away and rewrote
    its summary; now nothing in it changes and the recorded summary comes back."""
    run = copy_of(finished, tmp_path)
    with open(run / "ledger.jsonl", "a") as file:
        file.write('{"step": 3, "partial')
    before = tree_digest(run)
    summary = trainer(run, resume=True).train()
    assert summary == json.loads((run / "summary.json").read_text())
    assert tree_digest(run) == before


def test_resume_with_more_steps_extends_the_run_as_if_it_had_asked_for_them(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    trainer(run, steps=4, resume=True).train()
    whole = tmp_path / "whole"
    trainer(whole, steps=4).train()
    extended, uninterrupted = outputs(run), outputs(whole)
    assert extended["weights"] == uninterrupted["weights"]
    assert extended["ledger"] == uninterrupted["ledger"]
    assert extended["rollouts"] == uninterrupted["rollouts"]
    meta = json.loads((run / "config.json").read_text())
    assert meta["config"]["steps"] == meta["rlvr_fast_run"]["steps"] == 4
    assert meta["changes"] == [{"at_step": 3, "steps": [3, 4]}]


class Killed(BaseException):
    """Stands in for a kill: a BaseException, so no handler of the code under test eats it."""


def kill_at(monkeypatch, owner, name: str, call: int = 1, when=lambda *args: True):
    """Raise Killed at the ``call``-th call of ``owner.name`` whose arguments satisfy
    ``when``."""
    real = getattr(owner, name)
    calls = []

    def killed(*args, **kwargs):
        if when(*args):
            calls.append(1)
            if len(calls) == call:
                raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, killed)


def renaming_to(name: str):
    return lambda source, target: Path(target).name == name


KILL_POINTS = {
    "before config.json": (recorder, "write_json_atomic", 1),
    "during the before-training eval": (distributed, "evaluate_sharded", 1),
    "during step 1's rollouts, before the first checkpoint": (flat, "sample_groups", 2),
    "during the first checkpoint write": (state_file, "save_file", 1),
    "at the first checkpoint's rename": (os, "replace", 1, renaming_to(CHECKPOINT_NAME)),
    "during the after-training eval": (distributed, "evaluate_sharded", 2),
    "at the final directory's rename": (os, "replace", 1, renaming_to("final")),
    "before summary.json": (recorder, "write_json_atomic", 2),
}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_run_stopped_at_any_point_resumes_to_the_same_bytes(
    reference, tmp_path, monkeypatch, point
):
    """Regression: 7 of 25 kill trials (before the first checkpoint, during its write, during the
    before-training eval) could never be resumed. These stop the run in-process at each file
    commit point; tests/run/test_kill_resume.py SIGKILLs real processes at random times."""
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        kill_at(patch, *KILL_POINTS[point])
        with pytest.raises(Killed):
            trainer(run).train()
    trainer(run, resume=True).train()  # which cleans up after the killed writer first
    left = [p for p in run.rglob(".*") if p.name != LOCK_NAME]
    assert not left, "no temp file or half swap left behind (the lock file stays)"
    assert outputs(run) == reference


def test_resume_refuses_a_ledger_damaged_before_the_checkpoint(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    lines = (run / "ledger.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").unlink()
    before = tree_digest(run)
    with pytest.raises(RunDirectoryError, match=r"ledger.jsonl:2: not the JSON line of step 1"):
        trainer(run, resume=True)
    assert tree_digest(run) == before


def test_whole_lines_drops_only_what_came_after_the_checkpoint(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "par')
    whole_lines(path, 2)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    with pytest.raises(RunDirectoryError, match="2 whole lines, but the checkpoint is at step 3"):
        whole_lines(path, 3)


@pytest.mark.parametrize("damage", ["truncated", "wrong shapes", "step out of range"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_restored(finished, tmp_path, damage):
    run = copy_of(finished, tmp_path)
    (run / "summary.json").unlink()
    path = RunLayout(run).checkpoint
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        save_state(
            path,
            {
                "next_step": 99 if damage == "step out of range" else 2,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "generator": torch.Generator().get_state(),
                "torch_rng": torch.get_rng_state(),
            },
        )
    with pytest.raises(StateFileError, match=f"{CHECKPOINT_NAME}: "):
        trainer(run, resume=True)


IMPOSSIBLE = Problem(id="impossible", question="What is 12 + 30?", answer="-1", source="test")


def test_nonfinite_training_stops_at_its_step_with_the_last_checkpoint_intact(tmp_path):
    """Regression: lr=1e30 exited 0 with every weight inf. baseline runs a backward on every step,
    so step 0 makes the weights huge and step 1's loss or weights are not finite."""
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"step \d: non-finite .*allow_nonfinite=true"):
        trainer(run, arm="baseline", steps=4, lr=1e30, checkpoint_every=1, evals=None).train()
    stopped = len((run / "ledger.jsonl").read_text().splitlines()) - 1
    checkpoint = RunLayout(run).checkpoint
    resumed = trainer(
        run, arm="baseline", steps=4, lr=1e30, checkpoint_every=1, evals=None, resume=True
    )
    assert resumed.start_step == stopped, "the checkpoint is the one before the bad step"
    assert all(p.isfinite().all() for p in resumed.stepping.params)
    assert checkpoint.exists() and not (run / "summary.json").exists()


def test_allow_nonfinite_trains_on(tmp_path):
    summary = trainer(
        tmp_path / "run", arm="baseline", steps=2, lr=1e30, evals=None, allow_nonfinite=True
    ).train()
    assert summary["steps"] == 2


@pytest.mark.parametrize("name", ["../../x", "a/b", ".hidden", "", "x" * 65])
def test_eval_names_cannot_escape_the_run_directory(tmp_path, name):
    with pytest.raises(ValueError, match="eval set name"):
        trainer(tmp_path / "run", evals={name: EVALS["t"]})
    assert not (tmp_path / "run").exists()


def test_a_question_longer_than_the_model_context_is_refused_before_anything_is_written(tmp_path):
    huge = Problem(id="huge", question="1 + 1 = ? " * 1000, answer="2", source="big.jsonl")
    with pytest.raises(ValueError, match="big.jsonl: problem 'huge' has a prompt of"):
        trainer(tmp_path / "run", problems=[huge])
    assert not (tmp_path / "run").exists()


def test_a_finished_run_with_a_damaged_summary_finishes_again(finished, reference, tmp_path):
    run = copy_of(finished, tmp_path)
    (run / "summary.json").write_text("{")
    summary = trainer(run, resume=True).train()
    assert (run / "summary.json").read_text() == json.dumps(summary, indent=2) + "\n"
    assert outputs(run) == reference
