"""Data-parallel GRPO on gloo (CPU): a 2-rank run against one process taking both ranks'
questions (weights, optimizer state, ledger, evals), the collective zero-gradient decision,
sharded evaluation, resume with another world size refused, and a rank that dies or stops
answering: the other exits with one clear line within the timeout, and --resume finishes the run.

Each 2-rank run is two processes started here (``rlvr-fast train --nproc 2`` through torchrun,
or with torchrun's environment by hand where a test kills one rank), one OpenMP thread each."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rlvr_fast
from rlvr_fast.train import distributed
from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.cli.main import main, without_nproc
from rlvr_fast.models.checkpoint import load_model
from rlvr_fast.run.state_file import load_state
from rlvr_fast.run.layout import RunLayout

# Four questions a step (two a rank), 48 tokens: on the first 16 synthetic questions step 0 and
# step 3 are homogeneous on both ranks, step 1 has a contributing question on each rank and
# step 2 on rank 0 only (asserted below, so a change of model or sampler shows here first).
RUN = [
    "--arm",
    "ra_flat",
    "--steps",
    "4",
    "--set",
    "questions_per_step=4",
    "--set",
    "max_new_tokens=48",
    "--set",
    "eval_max_new_tokens=48",
    "--set",
    "gate_min_chars=null",
    "--set",
    "lr=1e-4",
    "--eval",
    "test=synthetic:test:10",
    "--quiet",
]
ROOT = Path(rlvr_fast.__file__).resolve().parents[1]


def child_env(**extra) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    for name in distributed.TORCHRUN_VARIABLES:
        env.pop(name, None)
    env.update(extra)
    return env


def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlvr_fast.cli", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
        **kwargs,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """``world`` ranks of ``rlvr-fast ARGS`` with torchrun's environment, without torchrun (whose
    agent would end the other ranks itself when one dies)."""
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "rlvr_fast.cli", *args],
            env=child_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for_lines(path: Path, count: int, procs, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank ended early: {[p.communicate() for p in procs]}")
        time.sleep(0.01)
    raise AssertionError(f"{path} never reached {count} lines")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process, two ranks): the same run directory settings."""
    base = tmp_path_factory.mktemp("dist")
    one, two = base / "one", base / "two"
    assert main(["train", *RUN, "--out", str(one)]) == 0
    done = cli("train", "--nproc", "2", *RUN, "--out", str(two))
    assert done.returncode == 0, done.stderr
    return one, two


def test_the_runs_cover_every_kind_of_step(runs):
    one, two = runs
    lines = read_jsonl(two / "ledger.jsonl")
    active = [[q["active"] for q in line["questions"]] for line in lines]
    # Rank 0 takes questions 0-1 of a step, rank 1 questions 2-3.
    assert active[0] == active[3] == [False] * 4, "every rank homogeneous"
    assert any(active[1][:2]) and any(active[1][2:]), "both ranks contribute"
    assert any(active[2][:2]) and not any(active[2][2:]), "rank 1 joins with zero gradients"
    assert [(line["active"], line["optimizer_step"]) for line in lines] == [
        (False, True),
        (True, True),
        (True, True),
        (False, True),
    ], "zero-gradient AdamW steps"
    assert json.loads((two / "config.json").read_text())["world_size"] == 2
    assert "world_size" not in json.loads((one / "config.json").read_text())


def test_two_ranks_equal_one_process_taking_both_ranks_questions(runs):
    """Same rollouts, so the same unit gradients; one process adds them in question order
    (``add_`` with the scale fused), two ranks each scale theirs and the all_reduce adds the
    two sums: fp32 rounding apart, which AdamW carries into the weights. Measured here: weights
    within 9e-7 after 4 steps at lr 1e-4 (bitwise on steps where one question contributes)."""
    single, double = (dict(load_model(run / "final").named_parameters()) for run in runs)
    for name, p in single.items():
        torch.testing.assert_close(p, double[name], rtol=0, atol=1e-5, msg=name)  # lr / 10
    states = [load_state(RunLayout(run).checkpoint) for run in runs]
    assert states[0]["world_size"] == 1 and states[1]["world_size"] == 2
    for a, b in zip(
        states[0]["optimizer"]["state"].values(),
        states[1]["optimizer"]["state"].values(),
        strict=True,
    ):
        assert int(a["step"]) == int(b["step"]) == 4, "an AdamW step on every step"
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-4, atol=1e-9)


def test_bitwise_where_no_two_unit_gradients_are_added(tmp_path):
    """Two questions a step, one a rank: on steps where at most one question contributes, both
    sides add nothing in another order, so weights and moments are bitwise equal."""
    args = [
        "train",
        "--arm",
        "ra_flat",
        "--steps",
        "3",
        "--set",
        "questions_per_step=2",
        "--set",
        "max_new_tokens=48",
        "--set",
        "gate_min_chars=null",
        "--set",
        "lr=1e-4",
        "--quiet",
    ]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    done = cli(*args, "--nproc", "2", "--out", str(tmp_path / "two"))
    assert done.returncode == 0, done.stderr
    lines = read_jsonl(tmp_path / "two" / "ledger.jsonl")
    assert [sum(q["active"] for q in line["questions"]) for line in lines] == [0, 0, 1]
    single, double = (
        dict(load_model(tmp_path / run / "final").named_parameters()) for run in ("one", "two")
    )
    assert all(torch.equal(p, double[name]) for name, p in single.items())
    states = [load_state(RunLayout(tmp_path / run).checkpoint) for run in ("one", "two")]
    for a, b in zip(
        states[0]["optimizer"]["state"].values(),
        states[1]["optimizer"]["state"].values(),
        strict=True,
    ):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def rounded_floats(line: dict) -> list:
    """Pop the step's and its questions' losses and gradient norms."""
    return [
        record.pop(name) for record in [line, *line["questions"]] for name in ("loss", "grad_norm")
    ]


def test_ledger_and_evals_equal_and_verify_passes(runs):
    one, two = runs
    for a, b in zip(
        read_jsonl(one / "ledger.jsonl"), read_jsonl(two / "ledger.jsonl"), strict=True
    ):
        # Timings differ and the KV peaks are per rank (summed); losses and gradient norms are
        # the same up to the rounding of the sums above; the rest is equal.
        for name in ("seconds", "peak_kv_blocks"):
            a.pop(name), b.pop(name)
        x, y = rounded_floats(a), rounded_floats(b)
        assert [v is None for v in x] == [v is None for v in y]
        assert [v for v in y if v is not None] == pytest.approx(
            [v for v in x if v is not None], rel=1e-5
        )
        assert a == b
    assert (one / "rollouts.jsonl").read_text() == (two / "rollouts.jsonl").read_text()
    # Sharded evaluation: each rank decodes 5 of the 10 items; the files list all 10 in order.
    for where in ("evals/before/test.jsonl", "evals/test.jsonl"):
        assert (one / where).read_text() == (two / where).read_text()
        assert len((two / where).read_text().splitlines()) == 10
    assert verify_run(two).ok


def test_resume_with_another_world_size_is_refused(runs, capsys):
    _, two = runs
    before = (two / "ledger.jsonl").read_text()
    assert main(["train", *RUN, "--out", str(two), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err
    assert "run of 2 rank(s); resume it with 2 (this run has 1)" in err
    assert (two / "ledger.jsonl").read_text() == before


def test_rank_dies_the_other_exits_with_one_line_then_resume_finishes(tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        *RUN,
        "--set",
        "checkpoint_every=1",
        "--set",
        "eval_before=false",
        "--steps",
        "5",
        "--dist-timeout",
        "60",
        "--out",
        str(out),
    ]
    procs = start_ranks(args)
    wait_for_lines(out / "ledger.jsonl", 1, procs)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, err = procs[0].communicate(timeout=90)
    seconds = time.monotonic() - killed
    procs[1].wait()
    assert procs[0].returncode == 3, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlvr-fast: error: rank 0 of 2: ") and "--resume" in last
    assert seconds < 30, (
        f"a dead peer closes its sockets: no wait for the 60 s timeout ({seconds:.1f} s)"
    )
    done = len(read_jsonl(out / "ledger.jsonl"))
    assert 1 <= done < 5

    resumed = cli("train", "--nproc", "2", *args[1:], "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert [line["step"] for line in read_jsonl(out / "ledger.jsonl")] == list(range(5))
    assert verify_run(out).ok


def test_rank_that_stops_answering_times_the_other_out(tmp_path):
    out = tmp_path / "run"
    procs = start_ranks(
        [
            "train",
            *RUN,
            "--set",
            "eval_before=false",
            "--steps",
            "8",
            "--dist-timeout",
            "5",
            "--out",
            str(out),
        ]
    )
    wait_for_lines(out / "ledger.jsonl", 1, procs)
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=60)
        seconds = time.monotonic() - stopped
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 3, err
    assert err.strip().splitlines()[-1].startswith("rlvr-fast: error: rank 0 of 2: ")
    assert 4 < seconds < 30, f"exit after the 5 s timeout, not a hang ({seconds:.1f} s)"


def test_one_process_helpers_are_the_identity():
    assert distributed.world_size() == 1 and distributed.rank() == 0 and distributed.is_main()
    assert distributed.shard(5) == slice(0, 5)
    assert distributed.sum_over_ranks(3) == 3 and distributed.all_gather("x") == ["x"]
    distributed.check_step_split(3, generation_steps=4)
    with pytest.raises(ValueError, match="resume it with 2"):
        distributed.check_world_size(2, RunLayout(Path("run")).checkpoint)
    assert without_nproc(["train", "--nproc", "2", "--arm", "x", "--nproc=3"]) == [
        "train",
        "--arm",
        "x",
    ]


def test_gradient_buckets_keep_order_and_split_by_size_and_dtype():
    grads = [torch.zeros(4), torch.zeros(4), torch.zeros(8), torch.zeros(2, dtype=torch.float64)]
    buckets = distributed._buckets(grads, bucket_bytes=40)
    assert [[g.numel() for g in b] for b in buckets] == [[4, 4], [8], [2]]
    assert all(a is b for a, b in zip([g for b in buckets for g in b], grads, strict=True))


@pytest.mark.parametrize(
    "device, current", [("cuda:1", [torch.device("cuda", 1)]), ("cuda", []), ("cpu", [])]
)
def test_one_process_on_cuda_n_makes_that_device_current(monkeypatch, device, current):
    """Outside torchrun, init sets the current device to cuda:N (Triton launches and CUDA-graph
    capture use it); a bare "cuda" or the CPU leave it. torch.cuda is mocked: no GPU here."""
    for name in distributed.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert distributed.init(device) == device
    assert calls == current
