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
AdamW's two moments (16 bytes per parameter in fp32).

    flock /tmp/bigmem.lock python -m benchmarks.bench_trl_memory   # about 15 GB at peak
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import bench_trl
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


def child(side: str, directory: Path, steps: int) -> dict:
    """Runs in the child: import, build the trainer, train; the resident set at each point."""
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
        reset_peak()
        trainer.train()
        trained_peak = status_bytes("VmHWM")
    params = sum(p.numel() for p in trainer.model.parameters())
    return {
        "side": side,
        "params": params,
        "imported": imported,
        "built_peak": built_peak,
        "built": built,
        "trained_peak": trained_peak,
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
    return "\n".join(lines)


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
