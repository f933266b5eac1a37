"""Sharded training (``--shard fsdp``, FSDP2 over gloo): ranks whose shards are stepped against
one process taking every question, and checkpoints that resume on another number of ranks.

One run of one process (3 steps) is the reference. A 2-rank sharded run stops after 2 steps; its
checkpoint (DCP shards) is resumed unsharded on one process and sharded on 4 ranks, and both
finish the 3 steps as the reference did: the same ledger (but timings and the KV peaks, which
are per rank), the same rollouts, weights within 1e-6 of the largest (the sums of the gradients
are reduced in another order)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlvr_fast
from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.train.memory_plan import RunShape, plan_memory
from rlvr_fast.cli.main import main
from rlvr_fast.run.state_file import load_state
from rlvr_fast.utils.locks import LOCK_NAME

from tests.train.test_distributed import child_env, cli, read_jsonl, rounded_floats

# Four questions a step, pooled (TRL's several prompts per step): on the first 12 synthetic
# questions step 0 is homogeneous everywhere, step 1 has a contributing question on both halves
# of the step and step 2 on its first half only (asserted below).
RUN = [
    "--arm",
    "ra_flat",
    "--set",
    "questions_per_step=4",
    "--set",
    "combine_questions=pooled",
    "--set",
    "max_new_tokens=32",
    "--set",
    "gate_min_chars=null",
    "--set",
    "lr=1e-4",
    "--set",
    "eval_before=false",
    "--quiet",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process, 3 steps; two sharded ranks, 2 steps)."""
    base = tmp_path_factory.mktemp("sharded")
    one, two = base / "one", base / "two"
    assert main(["train", *RUN, "--steps", "3", "--out", str(one)]) == 0
    done = cli("train", "--nproc", "2", "--shard", "fsdp", *RUN, "--steps", "2", "--out", str(two))
    assert done.returncode == 0, done.stderr
    return one, two


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def assert_same_run(one: Path, other: Path, weights_atol: float | None = None) -> None:
    """``other`` ran ``one``'s steps: ledger lines equal but timings and KV peaks, losses,
    gradient norms and TRL's policy figures to 1e-5 (or 1e-6 absolute: a loss sums terms of
    both signs, which cancel), rollouts equal, weights within 1e-6 of each tensor's largest
    (or within ``weights_atol``)."""
    for a, b in zip(
        read_jsonl(one / "ledger.jsonl"), read_jsonl(other / "ledger.jsonl"), strict=True
    ):
        for name in ("seconds", "peak_kv_blocks"):
            a.pop(name), b.pop(name)
        figures = [line.pop("policy", None) or {} for line in (a, b)]  # TRL's, to 1e-5
        assert figures[0].keys() == figures[1].keys()
        assert [figures[1][k] for k in figures[0]] == pytest.approx(
            list(figures[0].values()), rel=1e-5, abs=1e-6
        )
        x, y = rounded_floats(a), rounded_floats(b)
        assert [v is None for v in x] == [v is None for v in y]
        assert [v for v in y if v is not None] == pytest.approx(
            [v for v in x if v is not None], rel=1e-5, abs=1e-6
        )
        assert a == b
    assert (one / "rollouts.jsonl").read_text() == (other / "rollouts.jsonl").read_text()
    expected, got = weights(one), weights(other)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        bound = 1e-6 * tensor.abs().max() if weights_atol is None else weights_atol
        assert (got[name] - tensor).abs().max() <= bound, name
    assert verify_run(other).ok


def test_the_run_covers_a_rank_with_no_loss(runs):
    one, _ = runs
    active = [[q["active"] for q in line["questions"]] for line in read_jsonl(one / "ledger.jsonl")]
    assert active[0] == [False] * 4, "a zero-gradient step: no pass, no collective"
    assert any(active[1][:2]) and any(active[1][2:]), "both ranks of two run losses"
    assert any(active[2][:2]) and not any(active[2][2:]), "rank 1 of two runs zero passes"


def test_a_sharded_checkpoint_holds_each_ranks_shards_in_dcp(runs):
    _, two = runs
    checkpoint = two / "checkpoint"
    state = load_state(checkpoint / "state.safetensors")
    assert not {"model", "optimizer"} & state.keys(), "the weights and moments are in the shards"
    shards = checkpoint / state["shards"]["directory"]
    assert sorted(p.name for p in checkpoint.iterdir()) == [shards.name, "state.safetensors"]
    files = sorted(p.name for p in shards.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    sizes = [(shards / name).stat().st_size for name in files[1:]]
    assert abs(sizes[0] - sizes[1]) <= 0.1 * sizes[0], f"each rank writes half: {sizes}"


def test_two_sharded_ranks_resumed_on_one_process_finish_the_run(runs, tmp_path):
    one, two = runs
    resumed = tmp_path / "run"
    shutil.copytree(two, resumed)
    assert main(["train", *RUN, "--steps", "3", "--out", str(resumed), "--resume"]) == 0
    assert_same_run(one, resumed)


def test_two_sharded_ranks_resumed_on_two_data_parallel_ranks_finish_the_run(runs, tmp_path):
    """Each unsharded rank loads the DCP checkpoint's tensors whole."""
    one, two = runs
    resumed = tmp_path / "run"
    shutil.copytree(two, resumed)
    done = cli("train", "--nproc", "2", *RUN, "--steps", "3", "--out", str(resumed), "--resume")
    assert done.returncode == 0, done.stderr
    assert_same_run(one, resumed)
    assert list((resumed / "checkpoint").glob("shards-*")) == [], "whole tensors again"


@pytest.mark.slow
def test_two_sharded_ranks_resumed_on_four_sharded_ranks_finish_the_run(runs, tmp_path):
    one, two = runs
    resumed = tmp_path / "run"
    shutil.copytree(two, resumed)
    done = cli(
        "train", "--nproc", "4", "--shard", "fsdp", *RUN, "--steps", "3",
        "--out", str(resumed), "--resume",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_run(one, resumed)


def test_a_checkpoint_whose_shards_are_missing_is_refused_in_one_line(runs, tmp_path, capsys):
    _, two = runs
    run = tmp_path / "run"
    shutil.copytree(two, run)
    for shards in (run / "checkpoint").glob("shards-*"):
        shutil.rmtree(shards)
    ledger = (run / "ledger.jsonl").read_text()
    assert main(["train", *RUN, "--steps", "3", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a checkpoint of this run (its shards shards-" in err, err
    assert (run / "ledger.jsonl").read_text() == ledger


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, name, what",
    [
        (flip_a_byte, "__1_0.distcp", "differs from the file the checkpoint wrote"),
        (cut_in_half, "__0_0.distcp", "differs from the file the checkpoint wrote"),
        (flip_a_byte, ".metadata", "differs from the file the checkpoint wrote"),
        (Path.unlink, "__1_0.distcp", "is missing"),
    ],
)
def test_a_damaged_shard_file_is_refused_in_one_line_before_anything_is_restored(
    runs, tmp_path, capsys, damage, name, what
):
    """The state file lists each shard file's SHA-256: one flipped bit, a truncation or a
    removed file is named, on one process as on two sharded ranks."""
    _, two = runs
    run = tmp_path / "run"
    shutil.copytree(two, run)
    (shards,) = (run / "checkpoint").glob("shards-*")
    damage(shards / name)
    ledger = (run / "ledger.jsonl").read_text()
    sharded = tmp_path / "sharded"  # (this process keeps the lock of the run it resumes)
    shutil.copytree(run, sharded)
    assert main(["train", *RUN, "--steps", "3", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    expected = f"{run / 'checkpoint'}: {shards.name}/{name} {what} (damaged, truncated or removed)"
    assert "\n" not in err and expected in err, err
    assert (run / "ledger.jsonl").read_text() == ledger
    if name == "__1_0.distcp" and what == "is missing":
        done = cli(
            "train", "--nproc", "2", "--shard", "fsdp", *RUN, "--steps", "3",
            "--out", str(sharded), "--resume",
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert expected.replace(str(run), str(sharded)) in done.stderr, done.stderr
        assert (sharded / "ledger.jsonl").read_text() == ledger


def test_bf16_mixed_masters_in_the_shards_resume_on_one_process(tmp_path):
    """Under bf16-mixed the shards are the fp32 masters: one process loads them whole from the
    DCP checkpoint into its masters and its bf16 model, and finishes the run."""
    mixed = [*RUN, "--precision", "bf16-mixed"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "run"
    assert main(["train", *mixed, "--steps", "3", "--out", str(one)]) == 0
    done = cli(
        "train", "--nproc", "2", "--shard", "fsdp", *mixed, "--steps", "2", "--out", str(two)
    )
    assert done.returncode == 0, done.stderr
    assert "shards" in load_state(two / "checkpoint" / "state.safetensors")
    shutil.copytree(two, resumed)
    assert main(["train", *mixed, "--steps", "3", "--out", str(resumed), "--resume"]) == 0
    assert_same_run(one, resumed)


def test_polyak_sums_and_rng_states_in_the_shards_resume_on_one_process(tmp_path):
    """The Polyak sums are written as each rank's slice, the RNG states once, all in DCP; one
    process loads them whole and finishes the run and its average as one process alone does."""
    import torch.distributed.checkpoint as dcp

    averaged = [*RUN, "--set", "polyak_start=2"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "run"
    assert main(["train", *averaged, "--steps", "3", "--out", str(one)]) == 0
    done = cli(
        "train", "--nproc", "2", "--shard", "fsdp", *averaged, "--steps", "2", "--out", str(two)
    )
    assert done.returncode == 0, done.stderr
    state = load_state(two / "checkpoint" / "state.safetensors")
    assert not {"polyak", "generator", "torch_rng"} & state.keys(), "in the shards"
    assert state["shards"]["polyak_count"] == 1
    shards = two / "checkpoint" / state["shards"]["directory"]
    saved = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    polyak = {k.removeprefix("polyak.") for k in saved if k.startswith("polyak.")}
    assert polyak == {k.removeprefix("weights.") for k in saved if k.startswith("weights.")}
    chunks = saved["polyak.lm_head.weight"].chunks
    assert len(chunks) == 2, "each rank wrote its slice"
    assert {"replicated.generator", "replicated.torch_rng"} <= saved.keys()
    shutil.copytree(two, resumed)
    assert main(["train", *averaged, "--steps", "3", "--out", str(resumed), "--resume"]) == 0
    assert_same_run(one, resumed)
    expected = load_file(str(one / "final_polyak" / "model.safetensors"))
    got = load_file(str(resumed / "final_polyak" / "model.safetensors"))
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), name


def test_one_process_resumed_on_two_sharded_ranks_finishes_the_run(runs, tmp_path):
    one, _ = runs
    stopped, resumed = tmp_path / "stopped", tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--out", str(stopped)]) == 0
    shutil.copytree(stopped, resumed)  # (this process still holds the lock of the one it ran)
    done = cli(
        "train", "--nproc", "2", "--shard", "fsdp", *RUN, "--steps", "3",
        "--out", str(resumed), "--resume",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_run(one, resumed)


KILLED_RUN = Path(__file__).with_name("sharded_killed_run.py")


def kill_sharded_run(out: Path, point: str, times: int) -> None:
    """A 2-rank sharded run of 3 steps, a checkpoint after each, SIGKILLed at ``point`` the
    ``times``-th time it gets there (``sharded_killed_run.py``); torchrun ends the other rank."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(KILLED_RUN), point, str(times), "train", "--shard", "fsdp", *RUN]
        + ["--set", "checkpoint_every=1", "--steps", "3", "--out", str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0 and "Signal 9 (SIGKILL)" in done.stderr, done.stderr


def temp_files(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob(".*") if p.name != LOCK_NAME)


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_sharded_run_killed_mid_step_resumes_sharded_and_finishes_the_run(runs, tmp_path, ranks):
    """Killed on 2 ranks, resumed on the same number (then bit for bit the uninterrupted
    2-rank run) and on more."""
    one, _ = runs
    out = tmp_path / "run"
    # In step 1, where both ranks run losses (the zero-gradient step 0 moves the weights too:
    # its refresh is the first).
    kill_sharded_run(out, "step", 2)
    assert [line["step"] for line in read_jsonl(out / "ledger.jsonl")] == [0]
    assert load_state(out / "checkpoint" / "state.safetensors")["next_step"] == 1
    done = cli(
        "train", "--nproc", str(ranks), "--shard", "fsdp", *RUN, "--set", "checkpoint_every=1",
        "--steps", "3", "--out", str(out), "--resume",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_run(one, out)
    assert len(list((out / "checkpoint").glob("shards-*"))) == 1
    if ranks == 2:
        whole = tmp_path / "uninterrupted"
        done = cli(
            "train", "--nproc", "2", "--shard", "fsdp", *RUN, "--set", "checkpoint_every=1",
            "--steps", "3", "--out", str(whole),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert_bit_for_bit(whole, out)


def assert_bit_for_bit(run: Path, other: Path) -> None:
    """The same ledger lines but timings, the same rollouts and the same weights' bytes."""
    for a, b in zip(
        read_jsonl(run / "ledger.jsonl"), read_jsonl(other / "ledger.jsonl"), strict=True
    ):
        a.pop("seconds"), b.pop("seconds")
        assert a == b
    assert (run / "rollouts.jsonl").read_text() == (other / "rollouts.jsonl").read_text()
    expected, got = weights(run), weights(other)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.mark.parametrize(("point", "shard_directories"), [("shards", 1), ("save", 2)])
def test_a_sharded_run_killed_mid_save_keeps_its_last_checkpoint_and_resumes_on_one_process(
    runs, tmp_path, point, shard_directories
):
    """Killed in the save of the checkpoint after step 1: with its shards in their staging
    directory, or renamed into place with the state file naming them not yet renamed."""
    one, _ = runs
    out = tmp_path / "run"
    kill_sharded_run(out, point, 2)
    checkpoint = out / "checkpoint" / "state.safetensors"
    assert load_state(checkpoint)["next_step"] == 1, "the previous checkpoint, whole"
    assert temp_files(checkpoint.parent), "the killed save's staging directory or temp file"
    named = checkpoint.parent / load_state(checkpoint)["shards"]["directory"]
    shards = sorted(checkpoint.parent.glob("shards-*"))
    assert named in shards and len(shards) == shard_directories
    args = ["train", *RUN, "--set", "checkpoint_every=1", "--steps", "3", "--out", str(out)]
    assert main([*args, "--resume"]) == 0
    assert_same_run(one, out)
    assert temp_files(out) == []
    assert list(checkpoint.parent.glob("shards-*")) == [], "one process writes whole tensors"


def test_a_shard_write_that_fails_is_one_line_and_the_last_checkpoint_resumes(runs, tmp_path):
    """Rank 1's disk fills while it writes its shards of the checkpoint after step 1."""
    one, _ = runs
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(KILLED_RUN), "full", "2", "train", "--shard", "fsdp", *RUN]
        + ["--set", "checkpoint_every=1", "--steps", "3", "--out", str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("rlvr-fast: error:")]
    assert errors and all(
        "writing the checkpoint's shards failed: rank 1: OSError: [Errno 28] No space left" in e
        for e in errors
    ), done.stderr
    checkpoint = out / "checkpoint" / "state.safetensors"
    assert load_state(checkpoint)["next_step"] == 1
    args = ["train", *RUN, "--set", "checkpoint_every=1", "--steps", "3", "--out", str(out)]
    assert main([*args, "--resume"]) == 0
    assert_same_run(one, out)
    assert temp_files(out) == []


def test_sharding_one_process_is_refused_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--shard", "fsdp", *RUN, "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error: shard=fsdp needs several ranks") and "\n" not in err
    assert not out.exists()


def test_ranks_on_mixed_devices_are_refused_in_one_line_and_write_nothing(tmp_path):
    """Rank 1 on CUDA, rank 0 on the CPU: their backends (NCCL, gloo) would wait for each
    other until the timeout; each rank refuses in one line before either joins."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(KILLED_RUN), "mixed", "1", "train", "--shard", "fsdp", *RUN]
        + ["--steps", "1", "--out", str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0 and "(exitcode: 2)" in done.stderr, done.stderr  # (torchrun's)
    refusal = (
        "rlvr-fast: error: the ranks run on mixed devices (rank 0: cpu, rank 1: cuda): one "
        "process group needs one device type (cuda: NCCL, cpu: gloo); give every rank the same "
        "--device\n"
    )
    assert done.stderr.count(refusal) == 2, done.stderr
    assert not out.exists()


CONFIGS = Path(rlvr_fast.__file__).parent / "assets" / "configs"


def test_the_sharded_plan_divides_what_is_sharded_and_keeps_the_engine_copy():
    config = ModelConfig.from_file(CONFIGS / "qwen3-8b-base.json")
    run = RunShape(questions_per_step=8, activation_checkpointing=True)
    whole = plan_memory(config, 80 * 10**9, run)
    sharded = plan_memory(config, 80 * 10**9, dataclasses.replace(run, shard="fsdp", world_size=8))
    before, after = ({t.name: t for t in plan.terms} for plan in (whole, sharded))
    for name in ("fp32 master weights", "AdamW moments (fp32)", "gradients (fp32)"):
        assert after[f"{name}, 1/8"].bytes == -(-before[name].bytes // 8)
    assert after["engine's full copy, weights (bf16)"].bytes == before["weights (bf16)"].bytes
    assert "unit-gradient sum" in before and "unit-gradient sum" not in after
    # The root (embedding, untied head, norm) is the largest group: 2 x 151,936 x 4,096 + 4,096.
    root = 2 * 151_936 * 4_096 + 4_096
    assert after["gather transient"].bytes == root * (2 + 4)
    assert after["reduce-scatter buckets"].bytes == root * 4
    assert not whole.fits and sharded.fits


def test_plan_refuses_a_sharded_plan_of_one_rank_and_one_that_does_not_fit(capsys):
    model = str(CONFIGS / "qwen3-8b-base.json")
    assert main(["plan", "--model", model, "--device-memory", "80GB", "--shard", "fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rlvr-fast plan: memory plan: shard fsdp needs --nproc N >= 2"
    args = ["--device-memory", "24GB", "--shard", "fsdp", "--nproc", "8"]
    assert main(["plan", "--model", model, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "\n" not in captured.err.strip()
    assert "does not fit in 22.35 GiB" in captured.err and "the largest term is" in captured.err
