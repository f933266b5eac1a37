"""Time training arms in this process's rlvr_fast: one line of JSON per arm.

For A/B comparisons across commits: run it once per checkout, alternating, e.g.

    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/old-checkout python scripts/time_arms.py baseline,ra_flat
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/main python scripts/time_arms.py baseline,ra_flat

(run from outside both checkouts, so PYTHONPATH decides which package is imported). Each arm runs
``--steps`` steps on the embedded default (seed 42, lr 1e-4, no evaluation) in a temporary run
directory; the line holds the wall time of ``train()``, the generated tokens, milliseconds per
generated token and the ledger's seconds per phase.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import rlvr_fast
import rlvr_fast.train.trainer as trainer_module
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy

# Older checkouts name the trainer GRPOTrainer.
Trainer = getattr(trainer_module, "RLVRTrainer", None) or trainer_module.GRPOTrainer


def time_arm(arm: str, steps: int) -> dict:
    config = trainer_module.TrainConfig.from_arm(arm, steps=steps, seed=42, lr=1e-4)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            load_policy("tiny"),
            config,
            synthetic_problems("train", steps, seed=42),
            {},
            out_dir=out,
            progress=False,
        )
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        lines = [json.loads(line) for line in (Path(out) / "ledger.jsonl").read_text().splitlines()]
    generated = sum(line["gen"] for line in lines)
    phases: dict[str, float] = {}
    for line in lines:
        for phase, seconds in (line.get("seconds") or {}).items():
            phases[phase] = round(phases.get(phase, 0.0) + seconds, 3)
    return {
        "package": str(Path(rlvr_fast.__file__).parent),
        "arm": arm,
        "steps": steps,
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "ms_per_token": round(1000 * wall / max(generated, 1), 3),
        "phase_seconds": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", help="comma-separated arm names")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for arm in args.arms.split(","):
        print(json.dumps(time_arm(arm, args.steps)), flush=True)


if __name__ == "__main__":
    main()
