"""TRL's GRPOTrainer beside rlvr_fast's drop-in, in the same run: one script body, only the
import differs (``trl`` vs ``rlvr_fast``).

Both sides: the same checkpoint, the same synthetic prompts (the study's prompt template) and
order, G = 8 completions per prompt at temperature 0.8 / top-p 0.9, at most ``MAX_COMPLETION``
tokens, the same steps of P prompts each (per_device_train_batch_size = 8 P: one prompt per
step, and several, which rlvr_fast samples in one engine batch, each prompt prefilled once and
forked; 8 prompts is TRL's per_device_train_batch_size=64), loss_type dapo (TRL's default), fp32
on the CPU. TRL runs without gradient checkpointing (its faster setting here; rlvr_fast keeps
activations too). Models (``--model``): ``tiny``, the embedded checkpoint, rewarded by the
grader; ``0.6b-4-layers``, Qwen3-0.6B-Base's widths with 4 decoder layers and a tied head
(219M parameters, seeded random weights, written once under /tmp), completions of at most 32
tokens, rewarded 0/1 alternately within each group (random weights never answer right, and a
group of equal rewards would let rlvr_fast skip its backward while TRL runs it).
rlvr_fast runs its defaults: prefill-once-fork rollouts on the engine, the fused weighted NLL,
the zero-gradient AdamW step on zero-variance groups. Each side is timed over ``train()``
(model loading excluded); its generated tokens are its own rollouts' lengths, so the figure that
compares the two is seconds per 1,000 generated tokens (seconds per step is printed too), the
minimum over interleaved rounds. From the command line each run is a fresh process, which also
reports its peak resident set while training above its resident set after the imports (the
weights, and under TRL the pages of its memory-mapped checkpoint, included).

    python -m benchmarks.bench_trl --steps 10 --repeats 3 --prompts 1,4   # the README's table
    python -m benchmarks.bench_trl --steps 4 --repeats 2 --prompts 1,8 --model 0.6b-4-layers
    pytest benchmarks/bench_trl.py --benchmark-only            # in the shared harness
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.bench_load_memory import REPO, ensure_checkpoint, gb, reset_peak, status_bytes
from benchmarks.harness import mark
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.grading import grade_response
from rlvr_fast.models.policy import TINY_MODEL_DIR

GROUP = 8
MAX_COMPLETION = 256
# A quiet CPU run of either side: a log line per step, no reports, no saves, no progress bar
# (the TRL side-by-side tests run the same).
QUIET_CPU_RUN = dict(
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    bf16=False,
    use_cpu=True,
    disable_tqdm=True,
)
SIDES = ("trl", "rlvr_fast")


def correct(completions, answer, **kwargs):
    return [float(grade_response(c, a)) for c, a in zip(completions, answer)]


def alternating_reward(completions, **kwargs):
    """0, 1, 0, 1, ... over each group: every group has a gradient whatever the model writes."""
    return [float(i % 2) for i in range(len(completions))]


# name -> (checkpoint directory, decoder layers at Qwen3-0.6B's shape (None: as stored), the
# completion cap, the reward)
MODELS = {
    "tiny": (TINY_MODEL_DIR, None, MAX_COMPLETION, correct),
    "0.6b-4-layers": (Path("/tmp/qwen3-0.6b-4-layers-tied-fp32"), 4, 32, alternating_reward),
    "0.6b": (Path("/tmp/qwen3-0.6b-tied-fp32"), 28, 32, alternating_reward),
}


def checkpoint_dir(model: str) -> Path:
    """Model ``model``'s directory (written first for the Qwen3-0.6B-shaped ones)."""
    directory, layers, _, _ = MODELS[model]
    if layers is None:
        return Path(directory)
    return ensure_checkpoint(directory, layers=layers, tied=True)


def classes(side: str):
    if side == "trl":
        trl = pytest.importorskip("trl")
        return trl.GRPOConfig, trl.GRPOTrainer, dict(gradient_checkpointing=False)
    from rlvr_fast import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer, {}


def build(
    side: str,
    steps: int,
    out_dir: str,
    prompts: int = 1,
    *,
    model=TINY_MODEL_DIR,
    reward=correct,
    max_completion: int = MAX_COMPLETION,
    **settings,
):
    """The script body, up to ``trainer.train()``: ``steps`` steps of ``prompts`` prompts;
    ``settings`` override GRPOConfig fields on both sides."""
    from datasets import Dataset

    config_cls, trainer_cls, extra = classes(side)
    rows = [
        {"prompt": render_prompt(p.question), "answer": p.answer}
        for p in synthetic_problems("train", steps * prompts, seed=7)
    ]
    args = config_cls(
        output_dir=out_dir,
        max_steps=steps,
        num_generations=GROUP,
        per_device_train_batch_size=GROUP * prompts,
        max_completion_length=max_completion,
        temperature=0.8,
        top_p=0.9,
        learning_rate=1e-5,
        **QUIET_CPU_RUN,
        seed=42,
        **{**extra, **settings},
    )
    return trainer_cls(
        model=str(model), reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows)
    )


def generated_tokens(trainer, prompts: int) -> int:
    """Sum of completion lengths over the run, from the per-step logs (logging_steps=1)."""
    return round(
        sum(
            log["completions/mean_length"] * GROUP * prompts
            for log in trainer.state.log_history
            if "completions/mean_length" in log
        )
    )


def timed_run(side: str, steps: int, prompts: int = 1, model: str = "tiny") -> dict:
    _, _, cap, reward = MODELS[model]
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build(
            side,
            steps,
            out_dir,
            prompts,
            model=checkpoint_dir(model),
            reward=reward,
            max_completion=cap,
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    tokens = generated_tokens(trainer, prompts)
    return {
        "side": side,
        "prompts": prompts,
        "seconds": seconds,
        "steps": steps,
        "tokens": tokens,
        "s_per_1k_tokens": seconds / tokens * 1000,
        "s_per_step": seconds / steps,
    }


def child_run(side: str, steps: int, prompts: int, model: str) -> dict:
    """``timed_run`` in this (fresh) process, with its peak resident set above the imports."""
    classes(side)
    import datasets  # noqa: F401

    imported = status_bytes("VmRSS")
    reset_peak()
    row = timed_run(side, steps, prompts, model)
    return dict(row, peak_above_imports=status_bytes("VmHWM") - imported)


def measure(side: str, steps: int, prompts: int, model: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_trl",
            "--child",
            side,
            "--steps",
            str(steps),
            "--prompts",
            str(prompts),
            "--model",
            model,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("prompts", [1, 2])
@pytest.mark.parametrize("side", SIDES)
def test_grpo_steps_trl_vs_rlvr_fast(benchmark, side, prompts):
    pytest.importorskip("datasets")
    steps = 2
    results = []
    mark(
        benchmark,
        f"GRPO steps of {prompts} prompt(s), tiny model, CPU: trl vs rlvr_fast (same script)",
        "eager" if side == "trl" else "fast",
        work=steps,
        unit="steps",
    )
    benchmark.pedantic(
        lambda: results.append(timed_run(side, steps, prompts)), rounds=1, warmup_rounds=0
    )
    assert results[-1]["tokens"] > 0
    if benchmark.enabled:
        benchmark.extra_info["counts"] = {
            "s_per_1k_tokens": results[-1]["s_per_1k_tokens"],
            "generated_tokens": results[-1]["tokens"],
        }


def report(runs: dict[tuple[str, int], list[dict]], steps: int) -> list[str]:
    lines = [
        "| side | prompts / step | steps | generated tokens (min-time round) | "
        "s / 1k tokens (min) | s / step (min) | peak above imports GB (max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (side, prompts), rows in runs.items():
        best = min(rows, key=lambda r: r["s_per_1k_tokens"])
        lines.append(
            f"| {side} | {prompts} | {steps} | {best['tokens']} | "
            f"{best['s_per_1k_tokens']:.3f} | {min(r['s_per_step'] for r in rows):.3f} | "
            f"{gb(max(r['peak_above_imports'] for r in rows))} |"
        )
    for prompts in sorted({p for _, p in runs}):
        ours, theirs = runs["rlvr_fast", prompts], runs["trl", prompts]
        time_ratio = min(r["s_per_1k_tokens"] for r in ours) / min(
            r["s_per_1k_tokens"] for r in theirs
        )
        peak_ratio = max(r["peak_above_imports"] for r in ours) / max(
            r["peak_above_imports"] for r in theirs
        )
        lines.append(
            f"{prompts} prompt(s) per step: rlvr_fast / trl time per 1,000 tokens "
            f"{time_ratio:.2f}x, peak above imports {peak_ratio:.2f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", default="1,4", help="prompts per step, comma-separated")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layouts = [int(p) for p in args.prompts.split(",")]
    if args.child:
        print(json.dumps(child_run(args.child, args.steps, layouts[0], args.model)))
        return
    checkpoint_dir(args.model)  # written once, before any run is timed
    print(
        f"model {args.model}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    runs = {(side, p): [] for p in layouts for side in SIDES}
    for _ in range(args.repeats):
        for prompts in layouts:
            for side in SIDES:  # interleaved, so both sides see the same background load
                runs[side, prompts].append(measure(side, args.steps, prompts, args.model))
    print("\n".join(report(runs, args.steps)))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
