"""A GRPO step of the drop-in against this machine's floor, phase by phase.

The step is ``benchmarks/bench_trl.py``'s script body (the drop-in ``GRPOTrainer``, G = 8,
TRL's dapo loss, fp32 on the CPU) with its ledger on, P prompts per step, activation
checkpointing on or off (``gradient_checkpointing``), and a reward that splits every group (the
0/1 alternation of ``benchmarks/bench_trl_memory.py``), so that every step runs its backward.
After ``--steps`` steps the last step's ledger line gives the phases' seconds (rollout, reward,
forward, backward, optimizer) and token counts, and ``benchmarks/step_floor.py`` turns those into
the FLOPs of the ledger's own accounting and the work the step executes, whose GEMMs are then
timed in this process at the model's own matrix shapes (same threads, same machine load): each
phase's floor and its efficiency, floor / the phase's CPU seconds (one thread: on a shared
machine the wall time adds the waits for a core, so floor / wall seconds is printed beside it).
The step's wall and CPU time are timed by a callback around the step; what no phase labels is
printed as "outside the phases".

Models (``benchmarks.bench_trl.MODELS``): ``tiny`` (the embedded checkpoint, completions up to
256 tokens), ``0.6b-4-layers`` (Qwen3-0.6B-Base's widths, tied head, 4 decoder layers) and
``0.6b`` (its full shape: 28 layers, 596M parameters, about 12 GB at peak; ``flock
/tmp/bigmem.lock`` on a shared machine), both with seeded random weights and 32-token
completions, written once under /tmp. On a shared machine run it with OMP_NUM_THREADS=1: with
more threads than idle cores each parallel GEMM waits at its barrier for a descheduled thread,
and small GEMMs then take milliseconds.

    python -m benchmarks.bench_step_efficiency --model tiny --prompts 1,8
    flock /tmp/bigmem.lock python -m benchmarks.bench_step_efficiency --model 0.6b --prompts 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from transformers import PrinterCallback, TrainerCallback

from benchmarks import bench_trl, step_floor
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.utils import phases


class StepClock(TrainerCallback):
    """Wall and CPU seconds of each optimizer step (on_step_begin to on_step_end) and the CPU
    seconds of each of its phases (``rlvr_fast.utils.phases.Phases``, wrapped while the clock
    is ``installed``): at one thread on a shared machine a phase's CPU time is its work's, its
    wall time the work's and the waits for a core."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.cpu: list[dict[str, float]] = []
        self.phase_cpu: dict[str, float] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.phase_cpu = {}
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)
        self.cpu.append(dict(self.phase_cpu, step=time.process_time() - self.cpu_started))

    @contextlib.contextmanager
    def installed(self):
        timed, clock = phases.Phases.__call__, self

        @contextlib.contextmanager
        def with_cpu(phase, name):
            started = time.process_time()
            with timed(phase, name):
                yield
            spent = time.process_time() - started
            clock.phase_cpu[name] = clock.phase_cpu.get(name, 0.0) + spent

        phases.Phases.__call__ = with_cpu
        try:
            yield
        finally:
            phases.Phases.__call__ = timed


def run_steps(
    model: str, prompts: int, checkpointing: bool, steps: int
) -> tuple[dict, float, dict[str, float]]:
    """The last step's ledger line, wall seconds and CPU seconds (by phase, and "step")."""
    cap = bench_trl.MODELS[model][2]
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = bench_trl.build(
            "rlvr_fast",
            steps,
            out_dir,
            prompts,
            model=bench_trl.checkpoint_dir(model),
            reward=bench_trl.alternating_reward,
            max_completion=cap,
            ledger=True,
            gradient_checkpointing=checkpointing,
        )
        clock = StepClock()
        trainer.add_callback(clock)
        trainer.remove_callback(PrinterCallback)  # the per-step log lines
        with clock.installed():
            trainer.train()
        lines = (Path(out_dir) / "ledger" / "ledger.jsonl").read_text().splitlines()
    return json.loads(lines[-1]), clock.seconds[-1], clock.cpu[-1]


def phase_rows(
    record: dict, wall: float, shapes, checkpointing: bool, timer, cpu: dict[str, float]
) -> list[dict]:
    """One row per phase (and one for the whole step): wall and CPU seconds, executed GFLOP,
    the ledger's GFLOP, floor seconds, GEMM rate."""
    work = step_floor.executed_work(record, shapes, bench_trl.GROUP, checkpointing)
    ledger = step_floor.ledger_flops(record)
    ledger_by_phase = {
        "rollout": ledger["prefill"] + ledger["decode"],
        "forward": ledger["forward"],
        "backward": ledger["backward"],
    }
    rows = []
    for phase in step_floor.PHASES:
        phase_work = work.get(phase)
        rows.append(
            dict(
                phase=phase,
                seconds=record["seconds"].get(phase, 0.0),
                cpu=cpu.get(phase, 0.0),
                executed=phase_work.flops if phase_work is not None else 0,
                ledger=ledger_by_phase.get(phase, 0),
                floor=timer.floor(phase_work) if phase_work is not None else None,
                rate=timer.rate(phase_work) if phase_work is not None else None,
            )
        )
    outside = wall - sum(record["seconds"].values())
    outside_cpu = cpu["step"] - sum(row["cpu"] for row in rows)
    rows.append(
        dict(phase="outside the phases", seconds=outside, cpu=outside_cpu, executed=0, ledger=0)
    )
    rows.append(
        dict(
            phase="step",
            seconds=wall,
            cpu=cpu["step"],
            executed=sum(w.flops for w in work.values()),
            ledger=record["flops_full"],
            floor=sum(r.get("floor") or 0.0 for r in rows),
        )
    )
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| phase | wall s | CPU s | share of step (CPU) | executed GFLOP | ledger GFLOP | GEMM "
        "rate here GFLOP/s | floor s | efficiency (floor / CPU s) | floor / wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    step_cpu = rows[-1]["cpu"]

    def ratio(floor, seconds):
        return f"{floor / seconds:.2f}" if floor and seconds > 0 else "-"

    for row in rows:
        floor, rate = row.get("floor"), row.get("rate")
        lines.append(
            f"| {row['phase']} | {row['seconds']:.3f} | {row['cpu']:.3f} | "
            f"{row['cpu'] / step_cpu:.2f} | {row['executed'] / 1e9:,.1f} | "
            f"{row['ledger'] / 1e9:,.1f} | {f'{rate / 1e9:,.0f}' if rate else '-'} | "
            f"{f'{floor:.3f}' if floor is not None else '-'} | {ratio(floor, row['cpu'])} | "
            f"{ratio(floor, row['seconds'])} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(bench_trl.MODELS), default="tiny")
    parser.add_argument("--prompts", default="1,8", help="prompts per step, comma-separated")
    parser.add_argument("--checkpointing", default="on,off", help="on, off or on,off")
    parser.add_argument("--steps", type=int, default=2, help="steps run; the last is measured")
    args = parser.parse_args(argv)
    settings = [s == "on" for s in args.checkpointing.split(",")]
    config = ModelConfig.from_hf_dict(
        json.loads((bench_trl.checkpoint_dir(args.model) / "config.json").read_text())
    )
    shapes = step_floor.ModelShapes.of(config)
    print(
        f"model {args.model}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    for prompts in (int(p) for p in args.prompts.split(",")):
        for checkpointing in settings:
            record, wall, cpu = run_steps(args.model, prompts, checkpointing, args.steps)
            # Timed again beside each step: the machine's load moves between them.
            timer = step_floor.GemmTimer()
            rows = phase_rows(record, wall, shapes, checkpointing, timer, cpu)
            print(
                f"\n{prompts} prompt(s) x G = {bench_trl.GROUP}, activation checkpointing "
                f"{'on' if checkpointing else 'off'}, step {args.steps} of {args.steps}: "
                f"{record['gen']} generated tokens, {record['bwd_full']} trained (ledger), "
                f"load {os.getloadavg()[0]:.2f}"
            )
            print("\n".join(table(rows)))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
