"""Peak CPU memory of TRL's GRPOTrainer beside rlvr_fast's drop-in at Qwen3-0.6B's shape: one
script body, only the import differs (``trl`` vs ``rlvr_fast``), each side in a fresh process.

Both sides: the checkpoint of ``benchmarks/bench_load_memory.py`` (Qwen3-0.6B-Base's shape with
an untied LM head, 751.6M parameters, float32), G = 8 completions of one prompt per step,
``max_completion_length`` 32, ``steps`` optimizer steps, fp32 on the CPU, and
``gradient_checkpointing=True`` (TRL's default; rlvr_fast recomputes its decoder layers in
backward then). The reward alternates 0, 1 over each group's completions, so that every step has
a gradient (random weights never answer right, and a zero-variance group would let rlvr_fast skip
the backward). Each child reports its resident set after the imports, the peak (``VmHWM``)
while the trainer is built (the model loaded) and the peak while ``train()`` runs; the figure the
comparison is about is the training peak above the imports minus the weights, their gradients and
AdamW's two moments (16 bytes per parameter in fp32). The training peak is also split by phase
(``benchmarks.harness.PhasePeaks``: the peak resident set between each change of phase, no
sampling interval), so each transient beyond the state shows where it is held.

    flock /tmp/bigmem.lock python -m benchmarks.bench_trl_memory   # about 15 GB at peak
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import bench_trl
from benchmarks.harness import PhasePeaks
from benchmarks.bench_load_memory import (
    DEFAULT_CHECKPOINT,
    REPO,
    ensure_checkpoint,
    gb,
    reset_peak,
    status_bytes,
)

MAX_COMPLETION = 32
SIDES = bench_trl.SIDES
PHASES = ("rollout", "reward", "forward", "backward", "optimizer", "other")
# Weights, gradients and AdamW's exp_avg and exp_avg_sq, in float32.
STATE_BYTES_PER_PARAMETER = 16


def build(side: str, directory: Path, steps: int, out_dir: str):
    """The script body of ``benchmarks/bench_trl.py``, up to ``trainer.train()``, on the
    checkpoint at ``directory`` with checkpointing on and every group's rewards split."""
    return bench_trl.build(
        side,
        steps,
        out_dir,
        model=directory,
        reward=bench_trl.alternating_reward,
        max_completion=MAX_COMPLETION,
        gradient_checkpointing=True,
    )


def label_phases(side: str, trainer, peaks: PhasePeaks) -> None:
    """Each side's rollout, reward, forward, backward and optimizer step labelled in ``peaks``:
    rlvr_fast's own step phases (``rlvr_fast.utils.phases.Phases``, which its ledger times);
    TRL's generation and scoring (``_generate_and_score_completions``; the old and reference
    log-probabilities it computes count as rollout), its reward functions
    (``_calculate_rewards``), ``compute_loss``, the accelerator's ``backward``, and, on both
    sides, every optimizer step (torch's global step hooks; gradient clipping before it is
    "other" under TRL, rlvr_fast's "optimizer")."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    if side == "rlvr_fast":
        from rlvr_fast.utils import phases

        timed = phases.Phases.__call__

        @contextlib.contextmanager
        def labelled(self, name):
            with peaks.phase(name), timed(self, name):
                yield

        phases.Phases.__call__ = labelled
        return
    peaks.label(trainer, "_generate_and_score_completions", "rollout")
    peaks.label(trainer, "_calculate_rewards", "reward")
    peaks.label(trainer, "compute_loss", "forward")
    peaks.label(trainer.accelerator, "backward", "backward")
    register_optimizer_step_pre_hook(lambda *args: peaks.enter("optimizer"))
    register_optimizer_step_post_hook(lambda *args: peaks.leave())


def child(side: str, directory: Path, steps: int) -> dict:
    """Runs in the child: import, build the trainer, train; the resident set at each point and
    the peak of each phase of training."""
    import torch

    bench_trl.classes(side)
    import datasets  # noqa: F401

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    imported = status_bytes("VmRSS")
    with tempfile.TemporaryDirectory() as out_dir:
        reset_peak()
        trainer = build(side, directory, steps, out_dir)
        built_peak = status_bytes("VmHWM")
        built = status_bytes("VmRSS")
        peaks = PhasePeaks()
        label_phases(side, trainer, peaks)
        trainer.train()
        phase_peaks = peaks.close()
        phase_rises = peaks.rises
    params = sum(p.numel() for p in trainer.model.parameters())
    return {
        "side": side,
        "params": params,
        "imported": imported,
        "built_peak": built_peak,
        "built": built,
        "trained_peak": max(phase_peaks.values()),
        "phase_peaks": phase_peaks,
        "phase_rises": phase_rises,
    }


def measure(side: str, directory: Path, steps: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_trl_memory",
            "--child",
            side,
            str(directory),
            "--steps",
            str(steps),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> str:
    lines = [
        "| side | parameters | load: peak above imports GB | train: peak above imports GB | "
        "train: beyond weights, gradients, AdamW GB |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        state = STATE_BYTES_PER_PARAMETER * row["params"]
        peak = row["trained_peak"] - row["imported"]
        lines.append(
            f"| {row['side']} | {row['params'] / 1e6:,.1f}M | "
            f"{gb(row['built_peak'] - row['imported'])} | {gb(peak)} | {gb(peak - state)} |"
        )
    beyond = {
        row["side"]: row["trained_peak"]
        - row["imported"]
        - STATE_BYTES_PER_PARAMETER * row["params"]
        for row in rows
    }
    if set(beyond) == set(SIDES):
        lines.append(
            f"\nrlvr_fast / trl, beyond the state: {beyond['rlvr_fast'] / beyond['trl']:.2f}"
        )
    lines += ["", *phase_table(rows)]
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> list[str]:
    """Per phase of training, each side's peak above the imports less the state (the state
    exists in full from the first optimizer step on, so a phase of the first step can read
    below it; freed memory stays resident, so a phase after a larger one reads that one's
    peak) and the most the phase rose above the resident set it started from, GB."""
    sides = [row["side"] for row in rows]
    lines = [
        "| phase | "
        + " | ".join(f"{side}: peak beyond the state | {side}: rise in the phase" for side in sides)
        + " |",
        "|---|" + "---:|---:|" * len(sides),
    ]
    for phase in PHASES:
        cells = []
        for row in rows:
            peak = row["phase_peaks"].get(phase)
            state = STATE_BYTES_PER_PARAMETER * row["params"]
            cells.append("-" if peak is None else gb(peak - row["imported"] - state))
            rise = row.get("phase_rises", {}).get(phase)
            cells.append("-" if rise is None else gb(rise))
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.steps)))
        return
    directory = ensure_checkpoint(args.checkpoint)
    print(
        f"{directory}, {args.steps} steps, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load average before: "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(report([measure(side, directory, args.steps) for side in args.sides.split(",")]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
