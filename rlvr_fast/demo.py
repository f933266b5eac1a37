"""``make demo``: the embedded model on the held-out synthetic set, then one GRPO-sized group.

1. Greedy evaluation of the base policy on held-out synthetic test problems: accuracy, cap hits,
   and the split between short guesses and derivations (the two modes RL has to choose between).
2. For a few training problems, G = 8 rollouts at temperature 0.8 / top-p 0.9 (the study's rollout
   settings): rewards, σ_R and whether the group is homogeneous (σ_R = 0, no gradient signal).

    python -m rlvr_fast.demo [--model tiny|PATH] [--problems 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from rlvr_fast.data import DataError, load_problems, render_prompt, synthetic_problems
from rlvr_fast.engine.sampler import SamplingParams, sample
from rlvr_fast.evaluation import evaluate
from rlvr_fast.grading import grade_response, passes_gate
from rlvr_fast.models.checkpoint import CheckpointError
from rlvr_fast.models.config import ConfigError
from rlvr_fast.policy import load_policy
from rlvr_fast.tokenizer import TokenizerError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlvr_fast.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face directory")
    parser.add_argument("--eval-data", type=Path, help="JSON/JSONL problems (default: synthetic test)")
    parser.add_argument("--problems", type=int, default=200, help="held-out problems to grade")
    parser.add_argument("--groups", type=int, default=3, help="training problems to roll out")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help="write summary.json and eval.jsonl here")
    args = parser.parse_args(argv)
    for name in ("problems", "groups", "group_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def rollout_groups(policy, args) -> list[dict]:
    generator = torch.Generator(device=policy.device).manual_seed(args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.9)
    groups = []
    for problem in synthetic_problems("train", args.groups, seed=args.seed):
        out = sample(policy, [render_prompt(problem.question)] * args.group_size, params,
                     generator=generator)
        rewards = [float(grade_response(t, problem.answer)) for t in out.texts]
        groups.append({
            "question": problem.question, "answer": problem.answer, "rewards": rewards,
            "sigma_r": statistics.pstdev(rewards), "lengths": out.lengths,
            "derivations": sum(passes_gate(t) for t in out.texts),
            "example": out.texts[0]})
    return groups


def write_outputs(directory: Path, summary: dict, items: list[dict]) -> None:
    """Each file lands whole or not at all (temp file + rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("summary.json", json.dumps(summary, indent=2) + "\n"),
                       ("eval.jsonl", "".join(json.dumps(i) + "\n" for i in items))):
        handle, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temp, directory / name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        policy = load_policy(args.model, device=args.device)
        problems = (load_problems(args.eval_data, limit=args.problems) if args.eval_data
                    else synthetic_problems("test", args.problems, seed=args.seed))
    except (CheckpointError, ConfigError, TokenizerError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"model: {policy.path} ({policy.num_parameters():,} parameters, untied count)")
    result = evaluate(policy, problems, max_new_tokens=args.max_new_tokens, desc="greedy eval")
    summary = result.summary()
    print(f"greedy accuracy: {summary['correct']}/{summary['items']} = {summary['accuracy']:.1%}"
          f" | cap hits {summary['cap_hits']}")
    guess_acc = summary["short_guess_accuracy"]
    derive_acc = summary["derivation_accuracy"]
    print(f"short guesses: {summary['short_guess_fraction']:.1%} of responses, accuracy "
          f"{'n/a' if guess_acc is None else f'{guess_acc:.1%}'}; derivations: accuracy "
          f"{'n/a' if derive_acc is None else f'{derive_acc:.1%}'}")
    groups = rollout_groups(policy, args)
    for group in groups:
        state = "homogeneous (σ_R = 0)" if group["sigma_r"] == 0 else f"σ_R = {group['sigma_r']:.3f}"
        print(f"\nQ: {group['question']}  (answer {group['answer']})\n"
              f"   rewards {[int(r) for r in group['rewards']]} -> {state}; "
              f"{group['derivations']}/{len(group['rewards'])} derivations; lengths {group['lengths']}\n"
              f"   rollout 0: {group['example'].strip()[:160]!r}")
    summary["groups"] = groups
    if args.out:
        write_outputs(args.out, summary, [i.to_json() for i in result.items])
        print(f"\nwrote {args.out}/summary.json and eval.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
