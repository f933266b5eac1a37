"""TRL's policy-loss terms of a flat step (loss types beyond the study's sum, through
``rlvr_fast.ops.policy_loss``): the loss settings of a run, the reference model of ``kl_beta`` >
0, the log-probabilities a question's loss is measured against, and the step's figures (TRL's
metric names: ``entropy``, ``kl``, ``clip_ratio/*``, ``cispo_clip_ratio``).

The reference is a frozen copy of the policy at the start of the run (TRL loads its reference
from the model's path: the same weights), in bf16 on CUDA and in the run's dtype on the CPU. With
``sync_ref_model`` it is mixed into after every ``ref_model_sync_steps`` optimizer steps, ref <-
(1 - alpha) ref + alpha policy (TRL's ``SyncRefModelCallback``). Its log-probabilities, like
TRL's, are taken once per generation, after sampling and before the generation's first update.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from rlvr_fast.ops.policy_loss import CLIPPED_LOSS_TYPES, PolicyLossSettings, PolicyLossStats


def policy_settings(config) -> PolicyLossSettings:
    """The fused policy loss's settings of a run: TRL's, on one question's group (its own tokens
    normalise dapo and cispo: ``rlvr_fast.train.steps.pooled_weights`` renormalises a step of
    several questions)."""
    return PolicyLossSettings(
        loss_type=config.loss_type,
        importance_sampling_level=config.importance_sampling_level,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        delta=config.delta,
        beta=config.kl_beta,
        use_bias_correction_kl=config.use_bias_correction_kl,
        sapo_temperature_pos=config.sapo_temperature_pos,
        sapo_temperature_neg=config.sapo_temperature_neg,
        max_completion_length=config.max_new_tokens,
    )


@dataclass
class PolicyTerms:
    """What one question's policy loss is measured against and what its last pass found: the
    reference log-probabilities [N] (kl_beta > 0), the old ones [N] (None: one update per
    generation, where they are the current ones), the advantages [G], the lengths (0 for a
    completion masked out of the loss) and the last pass's ``PolicyLossStats``."""

    advantages: torch.Tensor
    lengths: list[int]
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    stats: PolicyLossStats | None = None

    def subset(self, indices: list[int]) -> "PolicyTerms":
        """The terms of completions ``indices`` alone (a step's share of its generation)."""
        starts = [0, *torch.tensor(self.lengths).cumsum(0).tolist()]

        def tokens(values: torch.Tensor | None) -> torch.Tensor | None:
            if values is None:
                return None
            pieces = [values[starts[i] : starts[i + 1]] for i in indices]
            return torch.cat(pieces) if pieces else values[:0]

        return PolicyTerms(
            self.advantages[indices],
            [self.lengths[i] for i in indices],
            tokens(self.ref_logprobs),
            tokens(self.old_logprobs),
        )


class ReferenceModel(torch.nn.Module):
    """A frozen copy of ``model`` (module docstring); ``sync_steps`` None: never mixed into."""

    def __init__(self, model: torch.nn.Module, sync_steps: int | None, alpha: float) -> None:
        super().__init__()
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if next(model.parameters()).is_cuda:
            self.model.to(torch.bfloat16)
        self.sync_steps, self.alpha = sync_steps, alpha

    def after_step(self, steps_done: int, model: torch.nn.Module) -> None:
        """TRL's sync after optimizer step ``steps_done`` (counted from 1)."""
        if self.sync_steps is None or steps_done % self.sync_steps:
            return
        with torch.no_grad():
            for ref, param in zip(self.model.parameters(), model.parameters(), strict=True):
                ref.mul_(1.0 - self.alpha).add_(param.to(ref.dtype), alpha=self.alpha)


def step_figures(terms: list[PolicyTerms], settings: PolicyLossSettings) -> dict[str, float]:
    """TRL's per-step policy metrics over every token (sequence-level ratios: every sequence)
    of the questions that ran a loss: entropy, kl (kl_beta > 0), the clip ratios of the clipped
    types or cispo's (epsilon_high None: epsilon, as TRL's); {} when none ran."""
    ran = [t for t in terms if t.stats is not None]
    if not ran:
        return {}
    stats = [t.stats for t in ran]
    figures = {"entropy": _token_mean([s.entropy for s in stats])}
    if settings.beta != 0.0:
        figures["kl"] = _token_mean([s.kl for s in stats])
    per_token_adv = [t.advantages.repeat_interleave(torch.tensor(t.lengths)) for t in ran]
    ratios = [s.ratio for s in stats]
    high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    if settings.loss_type in CLIPPED_LOSS_TYPES:
        low = [(r < 1 - settings.epsilon) & (a < 0) for r, a in zip(ratios, per_token_adv)]
        up = [(r > 1 + high) & (a > 0) for r, a in zip(ratios, per_token_adv)]
        lengths = [n for t in ran for n in t.lengths]
        level = settings.importance_sampling_level
        figures.update(
            {
                "clip_ratio/low_mean": _clip_mean(low, ran, settings),
                "clip_ratio/high_mean": _clip_mean(up, ran, settings),
                "clip_ratio/region_mean": _clip_mean(
                    [a | b for a, b in zip(low, up)], ran, settings
                ),
                "clip_ratio/low_min": min(_sequence_means(low, lengths, level)),
                "clip_ratio/high_max": max(_sequence_means(up, lengths, level)),
            }
        )
    elif settings.loss_type == "cispo":
        clipped = [(r > high) & (a > 0) for r, a in zip(ratios, per_token_adv)]
        figures["cispo_clip_ratio"] = _clip_mean(clipped, ran, settings)
    return figures


def _token_mean(values: list[torch.Tensor]) -> float:
    flat = torch.cat(values)
    return float(flat.sum() / max(flat.numel(), 1))


def _clip_mean(flags: list[torch.Tensor], ran: list[PolicyTerms], settings) -> float:
    """TRL's global mean of a clip flag: over tokens, or over sequences when the ratio is the
    sequence's."""
    if settings.importance_sampling_level == "token":
        return _token_mean([f.float() for f in flags])
    per_sequence = _sequence_means(flags, [n for t in ran for n in t.lengths], "sequence")
    return sum(per_sequence) / len(per_sequence)


def _sequence_means(flags: list[torch.Tensor], lengths: list[int], level: str) -> list[float]:
    """Each sequence's mean flag. A masked (empty) sequence: at token level 0/0, which TRL's
    nanmin / nanmax leave out; at sequence level its ratio exp(0) = 1, never clipped."""
    flat = torch.cat([f.float() for f in flags])
    means, start = [], 0
    for n in lengths:
        if n:
            means.append(float(flat[start : start + n].mean()))
        elif level == "sequence":
            means.append(0.0)
        start += n
    return means or [float("nan")]
