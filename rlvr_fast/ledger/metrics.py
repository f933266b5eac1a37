"""The figures of one ledger line that a run shows while it trains (the progress bar, the
``--log-every`` lines, TensorBoard and W&B scalars) and ``rlvr-fast report`` draws over steps:
computed from the line alone, so a run's curves can be drawn again from its ledger.

Names are TRL's where TRL logs the same figure (``reward``, ``reward_std``,
``frac_reward_zero_std``, ``loss``, ``grad_norm``, ``completions/*_length``, and the policy
figures of TRL's loss types, which the ledger already holds under TRL's names:
``rlvr_fast.ledger.records.POLICY_FIGURES``); rlvr_fast's own otherwise:
- ``accuracy``: the fraction of the step's completions rewarded 1 (graded correct, through the
  arm's derivation gate where it has one); on the study's 0/1 reward it is the reward mean, on a
  graded reward (TRL's reward functions) the share at full reward;
- ``active``: 1 when the step ran a backward pass, else 0;
- ``tokens/NAME`` and ``flops/NAME``: the ledger's token counts and FLOPs of the step;
- ``seconds/PHASE``: its seconds per phase (``reward`` is the time spent grading).
A figure the step does not have (no loss on a step without a backward pass, no KL at beta 0) is
left out, not written as 0.
"""

from __future__ import annotations

import math

from rlvr_fast.ledger.records import POLICY_FIGURES

TOKEN_FIGURES = ("gen", "pref", "bwd_out", "bwd_full")
FLOP_FIGURES = {"out": "flops_out", "full": "flops_full", "pad_full": "flops_pad_full"}
# The progress bar's short labels, in order; a figure the step lacks is left out.
BAR_LABELS = {
    "reward": "reward",
    "accuracy": "acc",
    "loss": "loss",
    "grad_norm": "gnorm",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/region_mean": "clip",
}
# The figures of a --log-every line, in order.
LOG_FIGURES = (
    "reward",
    "accuracy",
    "frac_reward_zero_std",
    "loss",
    "grad_norm",
    "kl",
    "entropy",
    "clip_ratio/region_mean",
    "completions/mean_length",
)


def question_records(line: dict) -> list[dict]:
    """A ledger line's per-question records: its "questions" on a multi-question step, else the
    line itself."""
    return line["questions"] if "questions" in line else [line]


def step_metrics(line: dict) -> dict[str, float]:
    """The figures of one ledger line (module docstring), by name."""
    questions = question_records(line)
    rewards = [r for q in questions for r in q["rewards"] if r is not None]
    lengths = [n for q in questions for n in q["lengths"]]
    metrics: dict[str, float] = {}
    if rewards:
        mean = sum(rewards) / len(rewards)
        metrics["reward"] = mean
        if len(rewards) > 1:
            spread = sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)
            metrics["reward_std"] = math.sqrt(spread)
        metrics["accuracy"] = sum(r == 1.0 for r in rewards) / len(rewards)
    metrics["frac_reward_zero_std"] = sum(q["homogeneous"] for q in questions) / len(questions)
    for name in ("loss", "grad_norm"):
        if line.get(name) is not None:
            metrics[name] = float(line[name])
    for name in POLICY_FIGURES:
        value = (line.get("policy") or {}).get(name)
        if value is not None:
            metrics[name] = float(value)
    metrics["completions/mean_length"] = sum(lengths) / len(lengths)
    metrics["completions/min_length"] = float(min(lengths))
    metrics["completions/max_length"] = float(max(lengths))
    metrics["active"] = float(bool(line["active"]))
    metrics.update({f"tokens/{name}": float(line[name]) for name in TOKEN_FIGURES})
    metrics.update({f"flops/{name}": float(line[key]) for name, key in FLOP_FIGURES.items()})
    metrics.update({f"seconds/{phase}": s for phase, s in line["seconds"].items()})
    return metrics


def bar_postfix(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's postfix: the step's reward, accuracy, loss and, when on, KL, entropy
    and clip fraction."""
    return {label: f"{metrics[name]:.3g}" for name, label in BAR_LABELS.items() if name in metrics}


def log_line(step: int, steps: int, metrics: dict[str, float]) -> str:
    """One ``--log-every`` line: the step (1-based, of ``steps``) and its figures."""
    figures = ", ".join(f"{name} {metrics[name]:.4g}" for name in LOG_FIGURES if name in metrics)
    seconds = sum(v for k, v in metrics.items() if k.startswith("seconds/"))
    return f"step {step}/{steps}: {figures}, {seconds:.2f} s"
