"""TRL's policy-loss terms of a flat step (loss types beyond the study's sum, through
``rlvr_fast.ops.policy_loss``): the loss settings of a run, the reference model of ``kl_beta`` >
0, TRL's adaptive entropy control (``EntropyControl``), the log-probabilities a question's loss
is measured against, and the step's figures (TRL's metric names: ``entropy``, ``kl``,
``clip_ratio/*``, ``cispo_clip_ratio``; with an entropy bonus ``entropy_coef`` and
``policy_loss``; rlvr_fast's ``high_entropy_fraction`` and ``policy_term_entropy``).

The reference is a frozen copy of the policy at the start of the run (TRL loads its reference
from the model's path: the same weights), in bf16 on CUDA and in the run's dtype on the CPU. With
``sync_ref_model`` it is mixed into after every ``ref_model_sync_steps`` optimizer steps, ref <-
(1 - alpha) ref + alpha policy (TRL's ``SyncRefModelCallback``). Under LoRA it is the policy's
frozen base with the adapters left out, as TRL disables a PeftModel's adapters: it shares the
base's tensors, copies nothing and has nothing of its own to checkpoint (and no sync, which TRL
refuses with peft too); adapters that start from given weights (a ``peft.PeftModel`` handed to
``GRPOTrainer``) are part of the reference, as TRL copies them into a frozen "ref" adapter: the
adapted projections' merged starting weights, the rest shared. Its log-probabilities, like
TRL's, are taken once per generation, after sampling and before the generation's first update.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from rlvr_fast.models.lora import base_twin, merged_twin
from rlvr_fast.ops.loss_types import loss_type, padded, token_mean
from rlvr_fast.ops.policy_loss import PolicyLossSettings, PolicyLossStats, high_entropy_mask
from rlvr_fast.train import distributed
from rlvr_fast.train.policy_config import op_settings


def policy_settings(config) -> PolicyLossSettings:
    """The fused policy loss's settings of a run: TRL's, on one question's group (its own tokens
    normalise dapo and cispo: ``rlvr_fast.train.steps.pooled_weights`` renormalises a step of
    several questions). Each setting of ``PolicyLossSettings`` takes the run's setting it was
    derived into (``rlvr_fast.train.policy_config``: under its ``run_name``, beta's kl_beta),
    ``loss_type`` and ``max_completion_length`` the run's loss_type and max_new_tokens; the
    values of one call keep their defaults (the accumulation and the batch's tokens: one
    question's group)."""
    values = {f.name: getattr(config, f.metadata["run_name"] or f.name) for f in op_settings()}
    return PolicyLossSettings(
        loss_type=config.loss_type, max_completion_length=config.max_new_tokens, **values
    )


class EntropyControl:
    """TRL's adaptive entropy control (Skywork-OR1's): after each optimizer step the
    coefficient moves by ``entropy_coef_delta`` up (the step's token-weighted mean entropy over
    the policy term's tokens at most ``entropy_target``) or down, within [``entropy_coef_min``,
    ``entropy_coef_max``]; a step applies the coefficient of the step before only when that
    step's entropy was at most the target (none before the first step: its entropy is inf).
    ``state_dict`` is what a checkpoint keeps (TRL's entropy_ctrl_state.json)."""

    def __init__(self, config) -> None:
        self.coef, self.last_entropy = config.entropy_coef, math.inf
        self.target, self.delta = config.entropy_target, config.entropy_coef_delta
        self.low, self.high = config.entropy_coef_min, config.entropy_coef_max

    def applied(self) -> float:
        """The coefficient this step's loss applies."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def after_step(self, entropy: float) -> None:
        """The step's mean entropy over the policy term's tokens: the next coefficient."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["entropy_coef"], state["last_world_entropy"]


def policy_term_entropy(
    entropy: torch.Tensor, lengths: list[int], settings: PolicyLossSettings
) -> float:
    """The mean entropy over the tokens of the policy term of one micro-batch (``entropy`` [N]
    of sequences of ``lengths``): every token, or TRL's high-entropy ones
    (top_entropy_quantile < 1); summed and divided in fp32 as TRL reduces them."""
    entropies, mask = padded(entropy, lengths), padded(torch.ones_like(entropy), lengths)
    if settings.top_entropy_quantile < 1.0:
        mask = mask * high_entropy_mask(entropies, mask, 1 - settings.top_entropy_quantile)
    return float((entropies * mask).sum() / mask.sum().clamp(min=1.0))


def high_entropy_fraction(
    entropy: torch.Tensor, lengths: list[int], settings: PolicyLossSettings
) -> float:
    """The share of the tokens in TRL's high-entropy mask (``policy_term_entropy``'s tokens)."""
    entropies, mask = padded(entropy, lengths), padded(torch.ones_like(entropy), lengths)
    kept = high_entropy_mask(entropies, mask, 1 - settings.top_entropy_quantile)
    return float(kept.sum()) / max(entropy.numel(), 1)


def entropy_coefficients(config, entropies: list[float]) -> list[float]:
    """The coefficient after each step of a run whose steps measured ``entropies`` (the
    adaptive control's inputs, recorded as ``policy_term_entropy``): ``verify``'s check."""
    control, coefficients = EntropyControl(config), []
    for entropy in entropies:
        control.after_step(entropy)
        coefficients.append(control.coef)
    return coefficients


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
    policy_loss: float | None = None  # the last loss before TRL's entropy bonus, when it has one

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


def reference_dtype(parameter: torch.Tensor) -> torch.dtype:
    """The reference copy's dtype: bf16 on CUDA (half the memory; the study's runs are bf16),
    the policy's own elsewhere."""
    return torch.bfloat16 if parameter.is_cuda else parameter.dtype


class ReferenceModel(torch.nn.Module):
    """A frozen copy of ``model`` (module docstring), or with ``adapters`` (LoRA) the frozen
    base they adapt; ``sync_steps`` None: never mixed into."""

    def __init__(
        self,
        model: torch.nn.Module,
        sync_steps: int | None,
        alpha: float,
        adapters=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """``dtype``: the copy's (default ``reference_dtype``: bf16 on CUDA; tests pass bf16 to
        build CUDA's pairing of an fp32 policy with a bf16 reference on the CPU)."""
        super().__init__()
        self.owns_weights = adapters is None
        if adapters is not None and adapters.start_at_base:  # no sync_ref_model with lora_r
            self.model = base_twin(adapters.model, adapters.layers)
        elif adapters is not None:
            # Adapters given at the start (a PeftModel's): TRL's reference is a frozen copy of
            # them, here their merged weights at the start, rebuilt from them in every start.
            self.model = merged_twin(adapters.model, adapters.layers)
        else:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)
            self.model.to(dtype or reference_dtype(next(model.parameters())))
        self.sync_steps, self.alpha = sync_steps, alpha

    def after_step(self, steps_done: int, model: torch.nn.Module) -> None:
        """TRL's sync after optimizer step ``steps_done`` (counted from 1)."""
        if self.sync_steps is None or steps_done % self.sync_steps:
            return
        with torch.no_grad():
            for ref, param in zip(self.model.parameters(), model.parameters(), strict=True):
                ref.mul_(1.0 - self.alpha).add_(param.to(ref.dtype), alpha=self.alpha)


# SequenceFigures' tensors, in its fields' order.
FIGURE_TENSORS = ("entropy", "ratio", "kl", "advantages")


@dataclass
class SequenceFigures:
    """Per-token figures of S sequences back to back (``PolicyLossStats``' entropy, ratio and
    kl [N]), with each sequence's advantage [S] and length (0: masked out of the loss)."""

    entropy: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    lengths: list[int]

    def to_cpu(self) -> "SequenceFigures":
        return SequenceFigures(
            *(getattr(self, name).cpu() for name in FIGURE_TENSORS), list(self.lengths)
        )

    @classmethod
    def of(cls, terms: list[PolicyTerms]) -> "SequenceFigures":
        stats = [t.stats for t in terms]
        return cls(
            torch.cat([s.entropy for s in stats]),
            torch.cat([s.ratio for s in stats]),
            torch.cat([s.kl for s in stats]),
            torch.cat([t.advantages.float().cpu() for t in terms]),
            [n for t in terms for n in t.lengths],
        )

    def select(self, sequences: list[int]) -> "SequenceFigures":
        """The figures of ``sequences`` (indices, in that order)."""
        starts = [0]
        for n in self.lengths:
            starts.append(starts[-1] + n)
        rows = [torch.arange(starts[i], starts[i + 1]) for i in sequences]
        tokens = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        tokens = tokens.to(self.entropy.device)
        return SequenceFigures(
            self.entropy[tokens],
            self.ratio[tokens],
            self.kl[tokens],
            self.advantages[list(sequences)],
            [self.lengths[i] for i in sequences],
        )


def step_figures(
    terms: list[PolicyTerms],
    settings: PolicyLossSettings,
    micro_batches: list[list[int]] | None = None,
    *,
    over_ranks: bool = False,
) -> dict[str, float]:
    """TRL's per-step policy metrics of the questions whose last pass was measured (every
    question of a step on TRL's loss types: those without a loss by a pass of their own):
    entropy, kl (kl_beta > 0), the clip ratios of the clipped types or cispo's (epsilon_high
    None: epsilon, as TRL's); {} when none was. TRL appends each figure once per micro-batch, over that micro-batch's tokens
    (sequence-level ratios: its sequences), and logs their mean: ``micro_batches`` (lists of
    sequence indices, question after question) cut the step so; None: one micro-batch."""
    measured = [t for t in terms if t.stats is not None]
    figures = SequenceFigures.of(measured) if measured else None
    if over_ranks:
        figures = gathered_figures(figures)
    if figures is None:
        return {}
    if micro_batches is None:
        return batch_figures(figures, settings)
    per_batch = [batch_figures(figures.select(b), settings) for b in micro_batches]
    return {name: _nan_mean([f[name] for f in per_batch]) for name in per_batch[0]}


def gathered_figures(figures: SequenceFigures | None) -> SequenceFigures | None:
    """Every rank's figures of its questions (a collective), in rank order, which is question
    order: the step's figures as one process taking every question has them."""
    parts = distributed.all_gather(None if figures is None else figures.to_cpu())
    parts = [part for part in parts if part is not None]
    if not parts:
        return None
    return SequenceFigures(
        *(torch.cat([getattr(p, name) for p in parts]) for name in FIGURE_TENSORS),
        [n for p in parts for n in p.lengths],
    )


def batch_figures(figures: SequenceFigures, settings: PolicyLossSettings) -> dict[str, float]:
    """TRL's policy metrics of one micro-batch (``step_figures``)."""
    values = {"entropy": token_mean(figures.entropy)}
    if settings.beta != 0.0:
        values["kl"] = token_mean(figures.kl)
    if settings.top_entropy_quantile < 1.0:  # rlvr_fast's figure: TRL logs no such metric
        values["high_entropy_fraction"] = high_entropy_fraction(
            figures.entropy, figures.lengths, settings
        )
    own = loss_type(settings.loss_type).figures  # the loss type's own (clip ratios, ...)
    values.update(own(figures.ratio.cpu(), figures.advantages, figures.lengths, settings))
    return values


def _nan_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN, as TRL logs a metric (NaN: none are)."""
    valid = [v for v in values if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else math.nan
