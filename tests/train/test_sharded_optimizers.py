"""The optimizers on shards (``--shard fsdp``): AdamW's three step implementations (for-loop,
foreach, fused) and Adafactor step each rank's shards as they step the whole tensors in one
process (AdamW bitwise: its update is elementwise; Adafactor within 1e-6: its column means and
RMS are summed over the ranks), on 3 ranks, whose uneven shards cut a stacked projection's
parts; runs of fused AdamW and of Adafactor on two sharded ranks match one process, and resume
across; the fused zero-gradient step folds each rank's shards bitwise, communicating nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr_fast.cli.main import main

from tests.train.test_distributed import child_env, cli
from tests.train.test_sharding import RUN, assert_same_run

HERE = Path(__file__).parent
STEPPED = re.compile(r"rank (\d): ([a-z -]+): largest difference (\S+), bitwise (True|False)")
ADAFACTOR_STATE = re.compile(r"rank (\d): adafactor state gathered (\S+), loaded and stepped (\S+)")


def torchrun(script: Path, ranks: int) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--nproc-per-node={ranks}", str(script)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_each_optimizer_steps_the_shards_as_it_steps_the_whole_tensors():
    stdout = torchrun(HERE / "sharded_optimizer_steps.py", 3)
    stepped = {(int(r), name): (float(d), b == "True") for r, name, d, b in STEPPED.findall(stdout)}
    names = ("adamw for-loop", "adamw foreach", "adamw fused", "adafactor")
    assert sorted(stepped) == sorted((r, n) for r in range(3) for n in names), stdout
    for (rank, name), (difference, bitwise) in stepped.items():
        assert difference <= 1e-6, (rank, name, difference)
        if name.startswith("adamw"):
            assert bitwise, (rank, name)
    state = ADAFACTOR_STATE.findall(stdout)
    assert sorted(int(r) for r, _, _ in state) == [0, 1, 2], stdout
    assert all(float(a) <= 1e-6 and float(b) <= 1e-6 for _, a, b in state), state


OPTIMIZERS = {
    "adamw fused": ["--set", "adamw_fused=true", "--set", "fused_zero_grad_step=false"],
    "adafactor": ["--set", "optimizer=adafactor", "--set", "fused_zero_grad_step=false"],
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_two_sharded_ranks_match_one_process_and_resume_on_it(optimizer, tmp_path):
    """3 steps on one process against 3 on two sharded ranks, and 2 sharded steps resumed on
    one process for the third (the state file holds the optimizer's state gathered whole)."""
    run = [*RUN, *OPTIMIZERS[optimizer]]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    assert main(["train", *run, "--steps", "3", "--out", str(one)]) == 0
    for out, steps in ((two, 3), (resumed, 2)):
        done = cli("train", "--nproc", "2", "--shard", "fsdp", *run, "--steps", str(steps),
                   "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert_same_run(one, two)
    assert main(["train", *run, "--steps", "3", "--out", str(resumed), "--resume"]) == 0
    assert_same_run(one, resumed)


def test_zero_gradient_steps_fold_on_each_shard_bitwise_without_communicating():
    stdout = torchrun(HERE / "sharded_zero_grad_fold.py", 2)
    for rank in range(2):
        assert f"rank {rank}: 35 shards, bitwise equal True, collectives 0 " in stdout, stdout
    counted = re.findall(r"a sharded norm's (\d+)", stdout)
    assert len(counted) == 2 and all(int(n) > 0 for n in counted), "the count sees collectives"


def test_a_run_of_one_process_resumes_adafactor_on_two_sharded_ranks(tmp_path):
    """The whole Adafactor state an unsharded checkpoint holds, cut into each rank's rows."""
    run = [*RUN, *OPTIMIZERS["adafactor"]]
    one, stopped = tmp_path / "one", tmp_path / "stopped"
    assert main(["train", *run, "--steps", "3", "--out", str(one)]) == 0
    assert main(["train", *run, "--steps", "2", "--out", str(stopped)]) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(stopped, resumed)  # (this process still holds the lock of the one it ran)
    done = cli("train", "--nproc", "2", "--shard", "fsdp", *run, "--steps", "3",
               "--out", str(resumed), "--resume")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_run(one, resumed)
