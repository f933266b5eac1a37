"""``benchmarks/step_floor.py``'s two counts of a step: the ledger's FLOPs split by phase sum to
the ledger's own figure, and the GEMMs it says a training pass executes are the ones torch
executes (every matrix product of the drop-in's loss, forward and backward, checkpointing on
and off); ``benchmarks/bench_step_efficiency.py`` on one real step labels its whole step."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import bench_step_efficiency, step_floor
from rlvr_fast.models.policy import load_policy
from rlvr_fast.ops.policy_loss import PolicyLossSettings
from rlvr_fast.train.losses import policy_loss


@pytest.fixture(scope="module")
def tiny_step():
    """Step 2 of a 2-prompt run of the benchmark's script on the tiny model: its ledger line,
    wall seconds and CPU seconds."""
    return bench_step_efficiency.run_steps("tiny", 2, checkpointing=True, steps=2)


def test_the_ledger_split_sums_to_the_ledger_figure(tiny_step):
    record, _, _ = tiny_step
    parts = step_floor.ledger_flops(record)
    assert set(parts) == {"prefill", "decode", "forward", "backward"}
    assert sum(parts.values()) == record["flops_full"] > 0
    assert all(value > 0 for value in parts.values())


def test_the_phases_cover_the_step(tiny_step):
    """Every phase the benchmark reports ran and was timed; together they are the step less
    what runs outside them (a positive remainder, never a phase counted twice)."""
    record, wall, cpu = tiny_step
    assert set(record["seconds"]) == set(step_floor.PHASES)
    assert all(seconds > 0 for seconds in record["seconds"].values())
    assert 0 < sum(record["seconds"].values()) < wall
    assert set(cpu) == {*step_floor.PHASES, "step"}
    assert 0 < sum(cpu[phase] for phase in step_floor.PHASES) <= cpu["step"]


def test_the_report_has_every_phase_and_a_floor(tiny_step):
    record, wall, cpu = tiny_step
    shapes = step_floor.ModelShapes.of(load_policy("tiny").model.config)
    rows = bench_step_efficiency.phase_rows(
        record, wall, shapes, checkpointing=True, timer=step_floor.GemmTimer(), cpu=cpu
    )
    names = [row["phase"] for row in rows]
    assert names == [*step_floor.PHASES, "outside the phases", "step"]
    step = rows[-1]
    assert step["ledger"] == record["flops_full"]
    assert step["executed"] == sum(row["executed"] for row in rows[:-1])
    assert step["cpu"] == pytest.approx(sum(row["cpu"] for row in rows[:-1]))
    assert 0 < step["floor"] == pytest.approx(sum(row.get("floor") or 0 for row in rows[:-1]))
    table = bench_step_efficiency.table(rows)
    assert len(table) == 2 + len(rows) and table[-1].startswith("| step |")


class GemmFlops(TorchDispatchMode):
    """FLOPs of every matrix product torch runs inside it (mm, addmm, addmm_, bmm): 2 M K N.
    FlopCounterMode would miss the in-place addmm_ the fused loss accumulates the head's dW
    with."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        if name in ("mm", "bmm"):
            a, b = args[:2]
        elif name in ("addmm", "addmm_"):
            a, b = args[1:3]
        else:
            a = b = None
        if a is not None:
            self.flops += 2 * math.prod(a.shape) * b.shape[-1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_counted_gemms_are_the_ones_a_training_pass_runs(checkpointing):
    """The forward and backward phases' GEMM FLOPs, counted from the shapes, equal those of the
    matrix products torch runs for the loss's forward and backward on the tiny model: the
    packed prompt once, the decoder layers (recomputed under checkpointing), the LM head's four
    GEMMs on the completion tokens only."""
    policy = load_policy("tiny")
    model = policy.model
    model.activation_checkpointing = checkpointing
    model.train()
    prompt, completions = list(range(5, 25)), [[7] * 5, [9] * 11, [3] * 2, [4] * 8]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    with GemmFlops() as measured:
        loss, _ = policy_loss(
            model, prompt, completions, advantages, PolicyLossSettings(loss_type="dapo")
        )
        loss.backward()
    question = dict(prompt_len=len(prompt), lengths=[len(c) for c in completions], bwd_full=1)
    record = dict(question, prefill_run=0, decode_rows=0, params=1)
    work = step_floor.executed_work(
        record, step_floor.ModelShapes.of(model.config), 4, checkpointing
    )
    counted = sum(g.flops for phase in ("forward", "backward") for g in work[phase].gemms)
    assert counted == measured.flops > 0


def test_causal_pairs_count_a_shared_prompt_once():
    # prompt of 3 (6 pairs), completions of 2 (2 x 3 + 3) and 1 (1 x 3 + 1)
    assert step_floor.causal_pairs(3, [2, 1]) == 6 + 9 + 4
