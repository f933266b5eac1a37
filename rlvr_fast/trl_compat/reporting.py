"""TRL's metrics of a step, from its scored groups, and TRL's completions log.

Per step (``step_metrics``), over all the step's completions as TRL computes them over a
generation batch: loss (the step's one loss as ``loss_type`` normalises it, the trainer's;
under the study's sum type TRL's surrogate at ratio 1), num_tokens (prompt and completion
tokens so far), completions/* (lengths, clipped ratio, terminated lengths), rewards/NAME/mean|std,
reward, reward_std, frac_reward_zero_std, and from the fused policy loss's own pass
(``rlvr_fast.train.policy.step_figures``) entropy, kl (beta > 0), clip_ratio/* (the clipped
types) or cispo_clip_ratio, over every completion of the step as TRL's: a group without a loss
(its rewards agree, beta = 0) has its figures from a pass without gradients. With
gradient_accumulation_steps micro-batches TRL logs the mean of each micro-batch's figure
(``micro_batches``). ``window_means`` averages a logging window as TRL does.
``CompletionsLog`` is TRL's ``log_completions``: a table printed at each log and saved as
``output_dir/completions/completions_STEP.jsonl``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from rlvr_fast.credit.group import scored_std, standardised_advantages
from rlvr_fast.train.losses import sequence_scales
from rlvr_fast.train.steps import generation_order
from rlvr_fast.trl_compat.rewards import ScoredGroup


def group_advantages(groups: list[ScoredGroup], config) -> list[torch.Tensor]:
    """Each group's advantages as the flat kind computes them (scale_rewards, advantage_std)."""
    step_std = None
    if config.advantage_std == "batch":
        step_std = scored_std([r for g in groups for r in g.rewards.tolist()])
    return [
        standardised_advantages(g.rewards.tolist(), scale=config.scale_rewards, scale_std=step_std)[
            0
        ]
        for g in groups
    ]


def sum_type_loss(groups, advantages, truncated, config) -> float:
    """The study's sum type, logged as TRL's surrogate at ratio 1: -sum_q c_q (1/G) sum_i A_i
    s_i |o_i| (c_q the pooled weights of ``rlvr_fast.train.steps``: 1 on a step of one prompt,
    the completions' share of the step on several)."""
    values = []
    for group, adv, cut in zip(groups, advantages, truncated):
        lengths = [len(ids) for ids in group.completion_ids]
        scales = sequence_scales(lengths, cut if config.mask_truncated else None)
        values.append(-float((adv * scales * torch.tensor(lengths)).sum()) / len(lengths))
    return sum(values) / len(values)


def micro_batches(config, step: int, sizes: list[int], count: int) -> list[list[int]]:
    """The sequences (indices into step ``step``'s, question after question) of each of its
    ``count`` micro-batches, as TRL cuts them: the generation's shuffle
    (``rlvr_fast.train.steps.generation_order``, which TRL draws from torch's global RNG, a draw
    no other run replays) cut into equal slices, the step's share of them in order."""
    steps = config.generation_steps
    generation, index = step // (steps * config.num_iterations), step % steps
    order = generation_order(config.seed, generation, sum(sizes))
    per_step = len(order) // steps
    mine = order[index * per_step : (index + 1) * per_step]
    # The step's sequences are its questions' shares, each in leaf order: by generation index.
    position = {completion: i for i, completion in enumerate(sorted(mine))}
    size = per_step // count
    return [[position[c] for c in mine[k * size : (k + 1) * size]] for k in range(count)]


def step_policy_figures(trainer, step: int) -> dict:
    """Step ``step``'s policy figures (``rlvr_fast.train.policy.step_figures``) over the
    micro-batches TRL would cut its completions into."""
    questions, count = trainer.trainer.generation, trainer.args.gradient_accumulation_steps
    batches = None
    if count > 1:
        sizes = [len(q.rollouts.completions) for q in questions]
        batches = micro_batches(trainer.trainer.config, step, sizes, count)
    return trainer.trainer.kind.figures(questions, batches)


def policy_metrics(config, figures: dict) -> dict:
    """The entropy, KL and clip metrics TRL logs for ``config``'s loss type, from the step's
    ``figures`` (module docstring for what a step without them logs)."""
    values = {"entropy": figures.get("entropy")}
    if config.kl_beta != 0.0:
        values["kl"] = figures.get("kl")
    if config.entropy_bonus:
        values["policy_loss"] = figures.get("policy_loss")
        if "entropy_coef" in figures:  # at training steps only
            values["entropy_coef"] = figures["entropy_coef"]
    # The loss type's own (rlvr_fast.ops.loss_types), each with what TRL logs without it.
    values.update({key: figures.get(key, empty) for key, empty in config.loss.metrics.items()})
    return values


def step_metrics(groups, config, eos_ids, names: list[str], num_tokens: int, record: dict) -> dict:
    """One step's TRL metrics (module docstring) from its scored groups and its ledger
    ``record``; ``num_tokens`` the running total."""
    lengths = [n for g in groups for n in g.lengths]
    truncated = [[c[-1] not in eos_ids for c in g.completion_ids] for g in groups]
    cut = [t for group in truncated for t in group]
    terminated = [n for n, c in zip(lengths, cut) if not c] or [0]
    advantages = group_advantages(groups, config)
    per_function = torch.cat([g.per_function for g in groups])
    rewards = torch.cat([g.rewards for g in groups])
    stds = group_stds(groups, config)
    values = {
        "loss": (
            sum_type_loss(groups, advantages, truncated, config)
            if not config.loss.fused
            else record["loss"] or 0.0
        ),
        "num_tokens": float(num_tokens),
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(cut) / len(cut),
        "completions/mean_terminated_length": sum(terminated) / len(terminated),
        "completions/min_terminated_length": float(min(terminated)),
        "completions/max_terminated_length": float(max(terminated)),
    }
    for index, name in enumerate(names):
        values[f"rewards/{name}/mean"] = nan_mean(per_function[:, index])
        values[f"rewards/{name}/std"] = nan_std(per_function[:, index])
    values.update(
        reward=nan_mean(rewards),
        reward_std=nan_std(rewards),
        frac_reward_zero_std=sum(s == 0.0 for s in stds) / len(stds),
    )
    values.update(policy_metrics(config, record.get("policy") or {}))
    return values


def group_stds(groups, config) -> list[float]:
    """The std each completion's advantage was scaled by (TRL's frac_reward_zero_std counts
    completions whose std is 0)."""
    if config.advantage_std == "batch":
        std = float(scored_std([r for g in groups for r in g.rewards.tolist()]))
        return [std for g in groups for _ in g.completion_ids]
    return [float(scored_std(g.rewards.tolist())) for g in groups for _ in g.completion_ids]


def window_means(metrics: dict[str, list]) -> dict:
    """A logging window's metrics as TRL logs them: means over steps (None and NaN left out; a
    metric with no value is None), num_tokens the running total."""
    logs = {}
    for name, values in metrics.items():
        valid = [v for v in values if v is not None and not math.isnan(v)]
        if not valid:
            logs[name] = None
        else:
            logs[name] = valid[-1] if name == "num_tokens" else sum(valid) / len(valid)
    return logs


def nan_mean(values: torch.Tensor) -> float:
    return float(values.nanmean())


def nan_std(values: torch.Tensor) -> float:
    """Bessel-corrected std of the non-NaN values (NaN with fewer than two), as TRL's nanstd."""
    valid = values[~values.isnan()]
    return float(valid.std()) if valid.numel() > 1 else float("nan")


class CompletionsLog:
    """TRL's log_completions: the completions since the last log, printed as a table of
    ``rows`` rows (None: all) and saved as JSONL under ``directory``."""

    def __init__(self, directory: Path, names: list[str], rows: int | None, unique: bool):
        self.directory, self.names, self.rows, self.unique = directory, names, rows, unique
        self.entries: list[dict] = []

    def add(self, step: int, groups: list[ScoredGroup], advantages: list[torch.Tensor]) -> None:
        for group, adv in zip(groups, advantages):
            for i, (prompt, completion) in enumerate(zip(group.prompts, group.completions)):
                entry = {"step": step, "prompt": prompt, "completion": completion}
                for index, name in enumerate(self.names):
                    value = float(group.per_function[i, index])
                    entry[name] = None if math.isnan(value) else value
                entry["advantage"] = float(adv[i])
                self.entries.append(entry)

    def flush(self, step: int) -> None:
        if not self.entries:
            return
        entries = self.entries
        if self.unique:
            seen, entries = set(), []
            for entry in self.entries:
                key = json.dumps(entry["prompt"], sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    entries.append(entry)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"completions_{step:05d}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
        print(completions_table(entries[: self.rows] if self.rows else entries, self.names, step))
        self.entries = []


def completions_table(entries: list[dict], names: list[str], step: int) -> str:
    """A plain-text table of prompts, completions, rewards and advantages."""
    header = ["prompt", "completion", *names, "advantage"]
    lines = [f"completions at step {step}", " | ".join(header)]
    for entry in entries:
        cells = [text_of(entry["prompt"]), text_of(entry["completion"])]
        cells += [f"{entry[n]:.2f}" if entry[n] is not None else "None" for n in names]
        cells.append(f"{entry['advantage']:.2f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def text_of(value) -> str:
    """A prompt or completion on one line (a conversation's last message)."""
    if isinstance(value, list):
        value = value[-1]["content"] if value else ""
    return " ".join(str(value).split())[:80]
