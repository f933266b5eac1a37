"""TRL's GRPOTrainer beside rlvr_fast's drop-in, in the same run: one script body, only the
import differs (``trl`` vs ``rlvr_fast``).

Both sides: the embedded tiny checkpoint, the same synthetic prompts (the study's prompt
template) and order, G = 8 completions per prompt at temperature 0.8 / top-p 0.9, at most
``MAX_COMPLETION`` tokens, the same steps of P prompts each (per_device_train_batch_size = 8 P:
one prompt per step, and several, which rlvr_fast samples in one engine batch, each prompt
prefilled once and forked), loss_type dapo (TRL's default), fp32 on the CPU. TRL
runs without gradient checkpointing (its faster setting here; rlvr_fast keeps activations too).
rlvr_fast runs its defaults: prefill-once-fork rollouts on the engine, the fused weighted NLL,
the zero-gradient AdamW step on zero-variance groups. Each side is timed over ``train()``
(model loading excluded); its generated tokens are its own rollouts' lengths, so the figure that
compares the two is seconds per 1,000 generated tokens (seconds per step is printed too), the
minimum over interleaved rounds.

    python -m benchmarks.bench_trl --steps 10 --repeats 3 --prompts 1,4   # the README's table
    pytest benchmarks/bench_trl.py --benchmark-only            # in the shared harness
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import pytest

from benchmarks.harness import mark
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.grading import grade_response
from rlvr_fast.models.policy import TINY_MODEL_DIR

GROUP = 8
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


def timed_run(side: str, steps: int, prompts: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build(side, steps, out_dir, prompts)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", default="1,4", help="prompts per step, comma-separated")
    args = parser.parse_args(argv)
    layouts = [int(p) for p in args.prompts.split(",")]
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    runs = {(side, p): [] for p in layouts for side in SIDES}
    for _ in range(args.repeats):
        for prompts in layouts:
            for side in SIDES:  # interleaved, so both sides see the same background load
                runs[side, prompts].append(timed_run(side, args.steps, prompts))
    print(
        "| side | prompts / step | steps | generated tokens (min-time round) | "
        "s / 1k tokens (min) | s / step (min) |"
    )
    print("|---|---|---|---|---|---|")
    for (side, prompts), rows in runs.items():
        best = min(rows, key=lambda r: r["s_per_1k_tokens"])
        print(
            f"| {side} | {prompts} | {args.steps} | {best['tokens']} | "
            f"{best['s_per_1k_tokens']:.3f} | {min(r['s_per_step'] for r in rows):.3f} |"
        )
    for prompts in layouts:
        ours = min(r["s_per_1k_tokens"] for r in runs["rlvr_fast", prompts])
        theirs = min(r["s_per_1k_tokens"] for r in runs["trl", prompts])
        print(
            f"{prompts} prompt(s) per step: rlvr_fast / trl time per 1,000 tokens {ours / theirs:.2f}x"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
