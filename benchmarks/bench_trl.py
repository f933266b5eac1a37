"""TRL's GRPOTrainer beside rlvr_fast's drop-in, in the same run: one script body, only the
import differs (``trl`` vs ``rlvr_fast``).

Both sides: the embedded tiny checkpoint, the same synthetic prompts (the study's prompt
template) and order, G = 8 completions per prompt at temperature 0.8 / top-p 0.9, at most
``MAX_COMPLETION`` tokens, the same steps, loss_type dapo (TRL's default), fp32 on the CPU. TRL
runs without gradient checkpointing (its faster setting here; rlvr_fast keeps activations too).
rlvr_fast runs its defaults: prefill-once-fork rollouts on the engine, the fused weighted NLL,
the zero-gradient AdamW step on zero-variance groups. Each side is timed over ``train()``
(model loading excluded); its generated tokens are its own rollouts' lengths, so the figure that
compares the two is seconds per 1,000 generated tokens (seconds per step is printed too).

    python -m benchmarks.bench_trl --steps 20 --repeats 3     # the README's table
    pytest benchmarks/bench_trl.py --benchmark-only            # in the shared harness
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import pytest

from benchmarks.harness import mark
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.grading import grade_response
from rlvr_fast.models.policy import TINY_MODEL_DIR

GROUP = 8
MAX_COMPLETION = 256
SIDES = ("trl", "rlvr_fast")


def correct(completions, answer, **kwargs):
    return [float(grade_response(c, a)) for c, a in zip(completions, answer)]


def classes(side: str):
    if side == "trl":
        trl = pytest.importorskip("trl")
        return trl.GRPOConfig, trl.GRPOTrainer, dict(gradient_checkpointing=False)
    from rlvr_fast import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer, {}


def build(side: str, steps: int, out_dir: str):
    """The script body, up to ``trainer.train()``."""
    from datasets import Dataset

    config_cls, trainer_cls, extra = classes(side)
    rows = [
        {"prompt": render_prompt(p.question), "answer": p.answer}
        for p in synthetic_problems("train", steps, seed=7)
    ]
    args = config_cls(
        output_dir=out_dir,
        max_steps=steps,
        num_generations=GROUP,
        per_device_train_batch_size=GROUP,
        max_completion_length=MAX_COMPLETION,
        temperature=0.8,
        top_p=0.9,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=42,
        **extra,
    )
    return trainer_cls(
        model=str(TINY_MODEL_DIR),
        reward_funcs=correct,
        args=args,
        train_dataset=Dataset.from_list(rows),
    )


def generated_tokens(trainer) -> int:
    """Sum of completion lengths over the run, from the per-step logs (logging_steps=1)."""
    return round(
        sum(
            log["completions/mean_length"] * GROUP
            for log in trainer.state.log_history
            if "completions/mean_length" in log
        )
    )


def timed_run(side: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build(side, steps, out_dir)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    tokens = generated_tokens(trainer)
    return {
        "side": side,
        "seconds": seconds,
        "steps": steps,
        "tokens": tokens,
        "s_per_1k_tokens": seconds / tokens * 1000,
        "s_per_step": seconds / steps,
    }


@pytest.mark.parametrize("side", SIDES)
def test_grpo_steps_trl_vs_rlvr_fast(benchmark, side):
    pytest.importorskip("datasets")
    steps = 4
    results = []
    mark(
        benchmark,
        "GRPO steps, tiny model, CPU: trl vs rlvr_fast (same script)",
        "eager" if side == "trl" else "fast",
        work=steps,
        unit="steps",
    )
    benchmark.pedantic(lambda: results.append(timed_run(side, steps)), rounds=1, warmup_rounds=0)
    assert results[-1]["tokens"] > 0
    if benchmark.enabled:
        benchmark.extra_info["counts"] = {
            "s_per_1k_tokens": results[-1]["s_per_1k_tokens"],
            "generated_tokens": results[-1]["tokens"],
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    runs = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:  # interleaved, so both sides see the same background load
            runs[side].append(timed_run(side, args.steps))
    print(
        "| side | steps | generated tokens (median) | s / 1k tokens (median) | s / step (median) |"
    )
    print("|---|---|---|---|---|")
    for side in SIDES:
        rows = runs[side]
        print(
            f"| {side} | {args.steps} | {statistics.median(r['tokens'] for r in rows):.0f} | "
            f"{statistics.median(r['s_per_1k_tokens'] for r in rows):.3f} | "
            f"{statistics.median(r['s_per_step'] for r in rows):.3f} |"
        )
    ratio = statistics.median(r["s_per_1k_tokens"] for r in runs["rlvr_fast"]) / statistics.median(
        r["s_per_1k_tokens"] for r in runs["trl"]
    )
    print(
        f"rlvr_fast / trl time per 1,000 generated tokens: {ratio:.2f}x; "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
