"""What a (possibly killed) ``rlvr-fast train`` run did, read back from its ledger: steps run,
seconds per phase, step time, rollouts at the cap. The GPU suite's end-to-end stage prints it.

Step time is the sum of every phase's seconds over the steps in the ledger (what the study's
438-530 s per 50-step run sets against); wall time adds start-up (imports, loading, KV cache,
the first CUDA graph captures) and the final checkpoint. A finished run shorter than the study's
50 steps reports its seconds per step and, labelled as a projection, step 0 plus 49 times the
mean of its later steps; a run stopped before its last step reports the steps it ran and their
seconds per step, never a figure scaled up to any longer run.

    python3 benchmarks/gpu/run_report.py RUN_DIR --exit-code 124 --wall-seconds 150.2 \\
        --limit-seconds 150 --headline HEADLINE_FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

STUDY_SECONDS = "438-530 s"
STUDY_STEPS = 50
TIMED_OUT = (124, 137)


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    config = json.loads((run_dir / "config.json").read_text())["config"]
    ledger = run_dir / "ledger.jsonl"
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    return config, [json.loads(line) for line in lines if line.strip()]


def how_it_ended(exit_code: int, steps_run: int, steps: int, limit: float | None) -> str:
    if exit_code == 0 and steps_run == steps:
        return "finished"
    if exit_code in TIMED_OUT:
        stopped = f"stopped at its {limit:.0f} s limit" if limit else "stopped by its time limit"
        return stopped + (" while writing the final checkpoint" if steps_run == steps else "")
    return f"failed (exit {exit_code})"


def report(run_dir: Path, exit_code: int, wall: float, limit: float | None) -> tuple[str, str]:
    """(markdown section, one-line headline)."""
    if not (run_dir / "config.json").exists():
        line = f"no run directory ({how_it_ended(exit_code, 0, 1, limit)}); see the log"
        return line + "\n", line
    config, records = read_run(run_dir)
    arm, steps, cap = config["arm"], config["steps"], config["max_new_tokens"]
    ended = how_it_ended(exit_code, len(records), steps, limit)
    out = [
        f"**{arm}**: {len(records)} of {steps} steps, {ended}; {wall:.1f} s wall time "
        "including start-up and the final checkpoint"
    ]
    if not records:
        return "\n".join(out) + "\n", f"{arm}: no step finished, {ended}"
    phases: dict[str, float] = {}
    for record in records:
        for name, seconds in record["seconds"].items():
            phases[name] = phases.get(name, 0.0) + seconds
    per_step = [sum(record["seconds"].values()) for record in records]
    step_time = sum(per_step)
    out += ["", "| phase | seconds | per step |", "|---|---|---|"]
    out += [
        f"| {name} | {seconds:.2f} | {seconds / len(records):.3f} |"
        for name, seconds in phases.items()
    ]
    out += [f"| step time (all phases) | {step_time:.2f} | {step_time / len(records):.3f} |", ""]
    if len(per_step) > 1:
        rest = per_step[1:]
        later = (
            f"step 1: {rest[0]:.3f} s"
            if len(rest) == 1
            else f"steps 1-{len(rest)}: mean {sum(rest) / len(rest):.3f} s, "
            f"min {min(rest):.3f}, max {max(rest):.3f}"
        )
        out.append(
            f"step 0: {per_step[0]:.2f} s (its first kernel compiles and CUDA graph "
            f"captures included); {later}"
        )
    lengths = [length for record in records for pair in record["pairs"] for length in pair[2:4]]
    categories = Counter(pair[6] for record in records for pair in record["pairs"])
    out.append(
        f"rollouts: {sum(n == cap for n in lengths)} of {len(lengths)} at the {cap}-token "
        f"cap; pairs {dict(categories)}; backward on {sum(r['active'] for r in records)} "
        f"steps"
    )
    out.append(
        "tokens: "
        + ", ".join(
            f"{key} {sum(r[key] for r in records):,}"
            for key in ("gen", "prefill_run", "decode_rows", "bwd_out")
        )
    )
    per_step_mean = step_time / len(records)
    if len(records) == steps >= STUDY_STEPS:
        out.append(
            f"**{steps}-step time: {step_time:.1f} s of step time** (the study: "
            f"{STUDY_SECONDS} per {STUDY_STEPS}-step run)"
        )
        headline = f"{arm}: {steps} steps, {step_time:.1f} s step time"
    elif len(records) == steps:
        out.append(
            f"**{steps} steps: {step_time:.1f} s of step time, {per_step_mean:.2f} s per step**"
        )
        headline = f"{arm}: {steps} steps, {per_step_mean:.2f} s per step"
        if len(per_step) > 1:
            projected = per_step[0] + (STUDY_STEPS - 1) * sum(per_step[1:]) / len(per_step[1:])
            out.append(
                f"{STUDY_STEPS}-step projection, not a measurement: step 0 + "
                f"{STUDY_STEPS - 1} x the mean of steps 1-{len(per_step) - 1} = "
                f"{projected:.0f} s (the study: {STUDY_SECONDS} per {STUDY_STEPS}-step run)"
            )
            headline += f" (projected {STUDY_STEPS}-step: {projected:.0f} s)"
    else:
        out.append(
            f"**no {steps}-step figure**: {len(records)} steps ran, {step_time:.1f} s of "
            f"step time, {per_step_mean:.2f} s per step (not extrapolated)"
        )
        headline = f"{arm}: {len(records)} of {steps} steps, {per_step_mean:.2f} s per step"
    return "\n".join(out) + "\n", headline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--exit-code", type=int, required=True, help="the train command's")
    parser.add_argument("--wall-seconds", type=float, required=True)
    parser.add_argument("--limit-seconds", type=float, help="the time limit it ran under")
    parser.add_argument("--headline", type=Path, help="append the one-line headline here")
    args = parser.parse_args()
    section, headline = report(args.run_dir, args.exit_code, args.wall_seconds, args.limit_seconds)
    print(section)
    if args.headline:
        with open(args.headline, "a", encoding="utf-8") as file:
            file.write(headline + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
