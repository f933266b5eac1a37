"""Sharded (FSDP2, ``shard="fsdp"``) against data-parallel training: peak resident memory per rank
and step time, 2 gloo ranks, the same step, measured side by side.

Each side is a fresh ``torchrun`` of this module (``--rank-side dp`` or ``fsdp``) on
Qwen3-0.6B-Base's widths (tied head; ``--layers`` decoder layers, 4 by default: the full 28 take
about 10 GB per data-parallel rank) in fp32 (``--precision bf16-mixed``: the mixed recipe), with
seeded random weights written once under /tmp. A step is the trainer's own
``OptimizerStepping.update`` of a pooled multi-question step: each rank's loss over a 64-token
prompt and 4 completions of 64 tokens (the fused weighted NLL), backward, AdamW; data parallel
all-reduces the gradients, sharded reduce-scatters them and then refreshes the engine's full copy
from the shards. Reported per rank: the state the optimizer steps (weights, gradients and AdamW
moments, by their tensors' bytes: sharded, this rank's shards), the peak resident set (``VmHWM`` of
/proc/self/status: this rank's own, imports included; not ``ru_maxrss``, which Linux carries across
fork + exec from the launcher) by phase (``benchmarks.harness.PhasePeaks``: the checkpoint's load,
the sharding, forward, backward, all_reduce, optimizer, the engine's refresh; the per-rank peak is
the largest), and the median step time; and on the sharded ranks, each rank's peak rise while a
checkpoint's weights and moments are saved, gathered whole (the format before DCP) and as each
rank's shards in DCP.

The goal (issue 36): state per rank <= 0.55x of data parallel's, total peak <= 0.65x. The engine's
full fp32 copy (4 bytes a parameter) stays on every rank, so in fp32 at 2 ranks the peak cannot
go below (4 + 16/2) / 16 = 0.75x of data parallel's 16 bytes a parameter; the ratio is printed as
measured. Communication is gloo over loopback here: the step time ratio is reported, not tuned.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_fsdp --layers 4 --steps 3

Measured here (2 shared CPU cores, torch 2.13, 4 layers, 218,507,264 parameters; tables,
conditions and the arithmetic in benchmarks/results/fsdp-cpu.md): state per rank 3.496 -> 1.748
GB (0.500x); peak per rank 5.52 -> 5.09 GB (0.922x), the sharded peak in backward, the data
parallel one in its first optimizer step. At 4 layers the tied embedding is 71% of the
parameters and the root's FSDP group: the sharded backward holds it gathered, the fused loss's
LM-head gradient and the embedding's gradient (then FSDP2's reduce-scatter input) at once, so
the peak is far above the 0.75x floor; more layers move it towards that floor. A sharded
checkpoint's save raises each rank's peak by 2.6 GB when the weights and moments are gathered
whole, by 0.003 GB in DCP. ``--precision bf16-mixed`` measures the mixed recipe (its floor:
(2 + 16/2) / 18 = 0.56x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import PhasePeaks
from rlvr_fast.utils.phases import Phases

CHECKPOINTS = "/tmp/qwen3-0.6b-{layers}-layers-tied-fp32"


def rank_side(side: str, directory: Path, steps: int, out: Path, precision: str) -> None:
    """One rank of ``side``: ``steps`` steps in ``precision``, then this rank's figures as JSON
    in ``out``."""
    import torch

    from rlvr_fast.models.policy import load_policy
    from rlvr_fast.train import distributed
    from rlvr_fast.train.config import TrainConfig
    from rlvr_fast.train.decision import decide_step
    from rlvr_fast.train.losses import fused_grpo_loss
    from rlvr_fast.train.sharding import shard_policy
    from rlvr_fast.train.stepping import OptimizerStepping

    distributed.init("cpu")
    import torch.distributed.fsdp  # noqa: F401  (imported before the peaks: seconds, not state)

    peaks = PhasePeaks("between phases")
    with peaks.phase("load"):
        policy = load_policy(directory, dtype=torch.float32)
    shard = "fsdp" if side == "fsdp" else None
    config = TrainConfig.from_arm(
        "ra_flat", questions_per_step=2, combine_questions="pooled", shard=shard
    )
    with peaks.phase("shard"):
        sharded = shard_policy(policy, precision) if shard else None
    if sharded is not None:
        peaks.label(sharded, "refresh", "refresh")
    stepping = OptimizerStepping(
        policy.model,
        config,
        precision,
        after_publish=sharded.refresh if sharded else None,
        sharded=sharded,
    )
    generator = torch.Generator().manual_seed(distributed.rank())
    vocab = policy.config.vocab_size
    prompt = torch.randint(vocab, (64,), generator=generator).tolist()
    completions = [torch.randint(vocab, (64,), generator=generator).tolist() for _ in range(4)]
    weights = [torch.randn(64, generator=generator) for _ in completions]

    def loss():
        return fused_grpo_loss(policy.trained_model, prompt, completions, weights)

    decision = decide_step(distributed.world_size(), skip_zero_var=True, zero_var_step="zero_grad")
    seconds = []
    for _ in range(steps):
        distributed.barrier("the step's start")
        started = time.perf_counter()
        stepping.update(
            PeakPhases(policy.device, peaks), decision, [loss], combination="pooled", weights=[1.0]
        )
        seconds.append(time.perf_counter() - started)
    stepped = stepping.stepped
    # The gradients are freed after a step: their bytes are the weights'.
    state = 2 * sum(_local_bytes(p) for p in stepped) + sum(
        _local_bytes(t)
        for entry in stepping.optimizer.state.values()
        for t in entry.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    phase_peaks = peaks.close()
    figures = {
        "phase_peaks": phase_peaks,
        "phase_rises": peaks.rises,
        "state_bytes": state,
        "peak_rss_bytes": max(phase_peaks.values()),
        "step_seconds": statistics.median(seconds[1:] or seconds),
        "parameters": sum(p.numel() for p in policy.model.parameters()),
    }
    if sharded is not None:
        figures.update(save_peaks(stepping, sharded, out))
    (out / f"{side}-{distributed.rank()}.json").write_text(json.dumps(figures))
    distributed.shutdown()


class PeakPhases(Phases):
    """The step's phases (``Phases``: wall time each), each also a phase of ``peaks``."""

    def __init__(self, device, peaks: PhasePeaks) -> None:
        super().__init__(device)
        self.peaks = peaks

    @contextlib.contextmanager
    def __call__(self, name: str):
        with self.peaks.phase(name), super().__call__(name):
            yield


def save_peaks(stepping, sharded, out: Path) -> dict:
    """This rank's peak rise above its resident set while the checkpoint's weights and moments
    are saved, the two ways a sharded run has: whole tensors gathered and written by rank 0 (the
    format before DCP, which an unsharded run still writes), and each rank's shards in DCP."""
    from benchmarks.bench_load_memory import reset_peak, status_bytes
    from rlvr_fast.run.state_file import save_state
    from rlvr_fast.train import distributed
    from rlvr_fast.train.sharded_checkpoint import ShardedCheckpoint
    from rlvr_fast.train.sharding import full_optimizer_state

    def rise(save) -> int:
        distributed.barrier("the save's start")
        reset_peak()
        before = status_bytes("VmRSS")
        save()
        return status_bytes("VmHWM") - before

    def whole() -> None:
        state = {
            "model": sharded.full_state(),
            "optimizer": full_optimizer_state(stepping.optimizer),
        }
        if distributed.is_main():
            save_state(out / "whole.safetensors", state)

    return {
        "save_whole_bytes": rise(whole),
        "save_dcp_bytes": rise(
            lambda: ShardedCheckpoint(stepping).save(out / "dcp" / "state.safetensors")
        ),
    }


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def run_side(side: str, directory: Path, steps: int, out: Path, precision: str) -> list[dict]:
    """Both ranks of ``side`` in a fresh torchrun; their figures."""
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--module",
            "benchmarks.bench_fsdp",
            "--rank-side",
            side,
            "--directory",
            str(directory),
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--precision",
            precision,
        ]
    )
    run(args)
    return [json.loads((out / f"{side}-{r}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="fp32")
    parser.add_argument("--rank-side", choices=("dp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side is not None:
        rank_side(args.rank_side, Path(args.directory), args.steps, Path(args.out), args.precision)
        return 0
    from benchmarks.bench_load_memory import ensure_checkpoint

    directory = ensure_checkpoint(
        Path(CHECKPOINTS.format(layers=args.layers)), layers=args.layers, tied=True
    )
    with tempfile.TemporaryDirectory() as out:
        dp = run_side("dp", directory, args.steps, Path(out), args.precision)
        fsdp = run_side("fsdp", directory, args.steps, Path(out), args.precision)
    params = dp[0]["parameters"]
    print(
        f"Qwen3-0.6B widths, {args.layers} layers, {params:,} parameters, {args.precision}, "
        "2 gloo ranks"
    )
    print(f"{'':>24} {'data parallel':>14} {'sharded':>10} {'ratio':>7}")
    for name, key, scale in (
        ("state per rank (GB)", "state_bytes", 1e9),
        ("peak RSS per rank (GB)", "peak_rss_bytes", 1e9),
        ("step (s)", "step_seconds", 1.0),
    ):
        a = max(rank[key] for rank in dp) / scale
        b = max(rank[key] for rank in fsdp) / scale
        print(f"{name:>24} {a:>14.3f} {b:>10.3f} {b / a:>7.3f}")
    phases = [name for name in dp[0]["phase_peaks"]] + [
        name for name in fsdp[0]["phase_peaks"] if name not in dp[0]["phase_peaks"]
    ]
    print(f"{'peak by phase (GB)':>24} {'data parallel':>14} {'sharded':>10}   rise dp / sharded")
    for name in phases:
        cells = []
        for ranks in (dp, fsdp):
            peak = max(rank["phase_peaks"].get(name, 0) for rank in ranks) / 1e9
            rise = max(rank["phase_rises"].get(name, 0) for rank in ranks) / 1e9
            cells.append((peak, rise))
        (a, ra), (b, rb) = cells
        print(f"{name:>24} {a:>14.3f} {b:>10.3f}   {ra:.3f} / {rb:.3f}")
    for name, key in (("whole tensors via rank 0", "save_whole_bytes"), ("DCP", "save_dcp_bytes")):
        rises = ", ".join(f"rank {r} {rank[key] / 1e9:.3f}" for r, rank in enumerate(fsdp))
        print(f"sharded checkpoint save, {name}: peak rise (GB) {rises}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
