"""Mixed precisions sharded (``--shard fsdp``): fp16-mixed's fp32 masters are the shards (FSDP2
casts them to fp16 for each pass and reduces in fp32) and its loss scale's overflow check is
agreed over the ranks, so a run on two sharded ranks matches one process, its loss scales
included, and an overflow in one rank's shard skips the step on every rank. A Polyak average
under bf16-mixed averages the shards, the fp32 masters (not the engine's bf16 copy): its
final_polyak/ is one process's, and its sums resume across (whole in the state file)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlvr_fast.cli.main import main

from tests.train.test_distributed import cli, read_jsonl
from tests.train.test_sharded_optimizers import torchrun
from tests.train.test_sharding import RUN, assert_same_run

HERE = Path(__file__).parent


def test_fp16_mixed_on_two_sharded_ranks_matches_one_process_and_resumes_on_it(tmp_path):
    run = [*RUN, "--precision", "fp16-mixed"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    assert main(["train", *run, "--steps", "3", "--out", str(one)]) == 0
    for out, steps in ((two, 3), (resumed, 2)):
        done = cli("train", "--nproc", "2", "--shard", "fsdp", *run, "--steps", str(steps),
                   "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
    scales = [line["loss_scale"] for line in read_jsonl(two / "ledger.jsonl")]
    assert scales == [{"scale": 65536.0, "skipped": False}] * 3
    assert_same_run(one, two)
    copy = tmp_path / "copy"
    shutil.copytree(resumed, copy)
    assert main(["train", *run, "--steps", "3", "--out", str(copy), "--resume"]) == 0
    assert_same_run(one, copy)


def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank():
    stdout = torchrun(HERE / "sharded_loss_scale.py", 2)
    for rank in range(2):
        assert (
            f"rank {rank}: an infinity in rank 1's shard found True; overflow on rank 0: "
            "{'scale': 65536.0, 'skipped': True}, grad norm None; clean: "
            "{'scale': 32768.0, 'skipped': False}, stepped True; scale 32768.0; "
            "weights moved [False, True]"
        ) in stdout, stdout


def test_a_polyak_average_of_sharded_fp32_masters_is_one_process_and_resumes_across(tmp_path):
    run = [*RUN, "--precision", "bf16-mixed", "--set", "polyak_start=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    to_one, to_two = tmp_path / "to_one", tmp_path / "to_two"
    for out, steps in ((one, 3), (to_two, 2)):
        assert main(["train", *run, "--steps", str(steps), "--out", str(out)]) == 0
    resumed = tmp_path / "resumed_sharded"
    shutil.copytree(to_two, resumed)  # (this process still holds the lock of the one it ran)
    for out, steps, resume in ((two, 3, []), (to_one, 2, []), (resumed, 3, ["--resume"])):
        done = cli("train", "--nproc", "2", "--shard", "fsdp", *run, "--steps", str(steps),
                   "--out", str(out), *resume)  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert main(["train", *run, "--steps", "3", "--out", str(to_one), "--resume"]) == 0
    expected = load_file(str(one / "final_polyak" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in expected.values()), "the masters' average"
    for other in (two, to_one, resumed):
        assert_same_run(one, other)
        got = load_file(str(other / "final_polyak" / "model.safetensors"))
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert got[name].dtype == torch.float32
            assert (got[name] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), name
