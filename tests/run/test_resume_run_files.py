"""A resume reads only regular files (issue 28, item 8, and new probes): a FIFO as summary.json,
ledger.jsonl or the checkpoint hung `train --resume`, a link to /dev/zero read until
MemoryError. Each is refused in one line before anything is read or written."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from hang_guard import within

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.utils.locks import LOCK_NAME
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import RunDirectoryError, run_files
from rlvr_fast.run.state_file import StateFileError, load_state
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer

SETTINGS = dict(max_new_tokens=16, eval_max_new_tokens=16, lr=1e-4, checkpoint_every=1)
PROBLEMS = synthetic_problems("train", 2, seed=3)


def trainer(out, resume=False):
    config = TrainConfig.from_arm("zg_flat", steps=2, **SETTINGS)
    return RLVRTrainer(
        load_policy("tiny"), config, PROBLEMS, {}, out_dir=out, resume=resume, progress=False
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    trainer(run).train()
    return run


def tree_digest(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != LOCK_NAME
    }


@pytest.mark.parametrize("name", [str(p) for p in run_files(Path()) if p.name != "config.json"])
@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero"])
def test_a_resume_refuses_a_run_file_that_is_not_a_regular_file(finished, tmp_path, name, kind):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / name).unlink()
    if kind == "FIFO":
        os.mkfifo(run / name)
    else:
        os.symlink("/dev/zero", run / name)
    before = tree_digest(run)
    with within(60), pytest.raises(RunDirectoryError, match=f"{name}: not a regular file"):
        trainer(run, resume=True)
    assert tree_digest(run) == before


def test_a_state_file_that_is_a_fifo_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "state.safetensors")
    with within(20), pytest.raises(StateFileError, match="state.safetensors: not a regular file"):
        load_state(tmp_path / "state.safetensors")
