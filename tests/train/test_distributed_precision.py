"""bf16-mixed data parallelism on gloo: two ranks, each with half of a batch, give the update of
one process with the whole batch. Each rank adds its bf16 gradient into its fp32 masters' and
the all-reduce sums those in fp32, so the two ranks equal, bit for bit, one process that runs
each half's backward and adds them in fp32 (the pooled step); against one backward of the summed
batch (bf16 gradients of the sum) they agree within bf16 rounding (the test's tolerance: 2% of
the update's norm, with AdamW's eps large enough that its update is linear in the gradient)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from rlvr_fast.models.policy import load_policy
from rlvr_fast.train import distributed
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.utils.phases import Phases

HALVES = (
    torch.tensor([[5, 17, 40, 3, 99, 120, 7, 64, 2, 31]]),
    torch.tensor([[8, 250, 11, 6, 42, 77, 19, 3, 140, 56]]),
)
ACTIVE = StepDecision(active=True, optimizer_step=True, contributing=2)
HERE = Path(__file__).parent


def half_loss(model, tokens: torch.Tensor):
    def loss():
        logits = model(tokens[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits[0], tokens[0, 1:], reduction="sum")

    return loss


def stepped_masters(
    halves: list[int], *, one_backward: bool = False, skewed_masters: bool = False
) -> dict[str, torch.Tensor]:
    """One bf16-mixed AdamW step of the tiny model on ``halves`` of the batch (pooled, one
    backward each, or one backward of their summed loss); the fp32 masters after it. With
    ``skewed_masters`` the masters start off by a fraction of a bf16 ulp (the bf16 weights
    unchanged), so only a broadcast of rank 0's masters, not of its bf16 weights, can make the
    ranks agree."""
    model = load_policy("tiny", dtype=torch.float32).model
    config = TrainConfig(lr=1e-3, eps=1.0, max_grad_norm=None)
    stepping = OptimizerStepping(model, config, "bf16-mixed")
    if skewed_masters:
        with torch.no_grad():
            for master in stepping.masters.parameters():
                master.mul_(1 + 2**-12)
    distributed.broadcast_parameters(model, stepping.masters)
    losses = [half_loss(model, HALVES[h]) for h in halves]
    phase = Phases(torch.device("cpu"))
    if one_backward:
        stepping.update(phase, ACTIVE, [lambda: sum(loss() for loss in losses)])
    else:
        stepping.update(phase, ACTIVE, losses, combination="pooled", weights=[1.0] * len(losses))
    return {name: m.detach().clone() for name, m in stepping.masters.named_parameters()}


def rank_main(out: str) -> None:
    """A rank of the two-process run (torchrun's environment): its half, its masters saved."""
    distributed.init("cpu")
    torch.save(stepped_masters([distributed.rank()], skewed_masters=distributed.rank() == 1), out)
    distributed.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_bf16_mixed_ranks_step_as_one_process_with_the_summed_batch(tmp_path):
    port = str(free_port())
    script = f"import sys; sys.path.insert(0, {str(HERE)!r}); import {Path(__file__).stem} as t; "
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script + f"t.rank_main({str(tmp_path / f'{r}.pt')!r})"],
            env=dict(
                os.environ,
                OMP_NUM_THREADS="1",
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    start = {n: p.detach().float() for n, p in load_policy("tiny").model.named_parameters()}
    pooled = stepped_masters([0, 1])
    summed = stepped_masters([0, 1], one_backward=True)
    for rank in ranks:
        _, err = rank.communicate(timeout=240)
        assert rank.returncode == 0, err
    for r in range(2):
        masters = torch.load(tmp_path / f"{r}.pt")
        for name, value in pooled.items():
            assert torch.equal(masters[name], value), (r, name)
    update = torch.cat([(pooled[n] - start[n]).flatten() for n in start])
    reference = torch.cat([(summed[n] - start[n]).flatten() for n in start])
    assert float((update - reference).norm() / reference.norm()) < 0.02
