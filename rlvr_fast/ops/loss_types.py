"""The loss types, one registered record each (``LOSS_TYPES``): everything the rest of the
package knows about a loss type is asked of its ``LossType``, never of its name.

A record holds the loss type's per-token objective (TRL 1.16's ``_compute_loss`` on the [S, T]
padded layout) or, for the study's sum, its loss through ``weighted_token_nll`` in one
``loss_order`` (two records: sum_then_scale, arm 1's, and token_weighted), its ``Normaliser`` (how the summed per-token
loss is divided, and so what a question's share of a pooled step counts), the shared settings
of ``PolicyLossSettings`` it reads and the settings of its own it declares (``own_setting``:
fields of ``PolicyLossSettings``, and from there the run's settings and the facade's), and its
figures: the function computing them from a micro-batch's ratios and the names they carry, in
the ledger and in TRL's logs alike, with the value TRL logs on a step that has none.

Adding a loss type is one ``register(LossType(...))`` here: its objective, a normaliser, its
settings of its own, its figures. The registry holds one record per (loss type, loss order):
TRL's types are token-weighted only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlvr_fast.utils.settings import setting

from rlvr_fast.ops.weighted_nll import weighted_token_nll


def padded(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[N] tokens of sequences back to back -> TRL's zero-padded [S, max_len]."""
    return torch.nn.utils.rnn.pad_sequence(list(values.split(lengths)), batch_first=True)


def unpadded(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[S, max_len] -> [N], by the host's lengths (a boolean mask would sync with the device)."""
    return torch.cat([row[:n] for row, n in zip(values, lengths)])


@dataclass(frozen=True)
class Normaliser:
    """How a loss type reduces its per-token loss [S, T] under ``mask`` to one number
    (``aggregate(per_token_loss, mask, settings)``, divided for gradient accumulation as TRL
    divides it in training), and what that makes a question's weight in a step that pools
    several (``rlvr_fast.train.steps.pooled_weights``): its tokens (``counts_tokens``) or its
    completions. ``over_generation``: TRL divides by the generation batch's tokens
    (num_items_in_batch) rescaled to one optimizer step, so a step on a share of a generation
    normalises by the generation's. ``per_micro_batch``: the divisor depends on which sequences
    TRL's shuffle puts in a micro-batch."""

    name: str
    aggregate: Callable
    counts_tokens: bool
    over_generation: bool = False
    per_micro_batch: bool = False


def _mean_of_sequence_means(per_token_loss, mask, settings) -> torch.Tensor:
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean() / settings.gradient_accumulation_steps


def _micro_batch_tokens(per_token_loss, mask, settings) -> torch.Tensor:
    total = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return total / settings.gradient_accumulation_steps


def _max_length(per_token_loss, mask, settings) -> torch.Tensor:
    size = per_token_loss.size(0) * settings.max_completion_length
    return (per_token_loss * mask).sum() / size / settings.gradient_accumulation_steps


def _mean_of_sequence_sums(per_token_loss, mask, settings) -> torch.Tensor:
    return (per_token_loss * mask).sum(-1).mean() / settings.gradient_accumulation_steps


def _generation_tokens(per_token_loss, mask, settings) -> torch.Tensor:
    """TRL's num_items_in_batch (default here: this call's tokens), already one window's."""
    items = settings.num_items_in_batch
    normalizer = mask.sum() if items is None else torch.tensor(float(items))
    return (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)


def _study_sum(per_token_loss, mask, settings) -> torch.Tensor:
    raise ValueError("the study's sum is weighted_token_nll's, not the fused policy loss's")


SEQUENCE_MEANS = Normaliser("sequence_means", _mean_of_sequence_means, counts_tokens=False)
MICRO_BATCH_TOKENS = Normaliser(
    "micro_batch_tokens", _micro_batch_tokens, counts_tokens=True, per_micro_batch=True
)
MAX_LENGTH = Normaliser("max_length", _max_length, counts_tokens=False)
SEQUENCE_SUMS = Normaliser("sequence_sums", _mean_of_sequence_sums, counts_tokens=False)
GENERATION_TOKENS = Normaliser(
    "generation_tokens", _generation_tokens, counts_tokens=True, over_generation=True
)
# The study's sum: -(1/G) sum_i A_i s_i sum_t log pi, an average over the group's completions.
GROUP_SIZE = Normaliser("group_size", _study_sum, counts_tokens=False)


def upper_clip(settings) -> float:
    """epsilon_high, or epsilon when it is None (TRL's)."""
    return settings.epsilon if settings.epsilon_high is None else settings.epsilon_high


def clipped_objective(coef_1, advantages, per_token_logps, log_ratio, mask, settings):
    """PPO's clipped surrogate, -min(r A, clip(r, 1 - eps, 1 + eps_high) A), r capped at delta."""
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon, 1 + upper_clip(settings))
    if settings.delta is not None:
        coef_1 = torch.clamp(coef_1, max=settings.delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def cispo_objective(coef_1, advantages, per_token_logps, log_ratio, mask, settings):
    """-sg(min(r, eps_high)) A log p: the clipped ratio weights the policy gradient."""
    clamped_ratios = torch.clamp(coef_1, max=upper_clip(settings)).detach()
    return -clamped_ratios * advantages * per_token_logps


def sapo_objective(coef_1, advantages, per_token_logps, log_ratio, mask, settings):
    """SAPO's soft gate, -sigmoid(tau (r - 1)) 4 / tau A, tau by the advantage's sign."""
    temperatures = torch.where(
        advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg
    )
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * advantages


@torch.no_grad()
def gamma_weights(advantages, log_ratio, mask, settings) -> torch.Tensor:
    """VESPO's sequence weight [S, 1] (TRL's ``get_gamma_weights``, no sampler correction):
    phi(w) = e^lambda w^k e^(-lambda w), phi(1) = 1, of w the sequence's ratio exp(sum of the
    token log-ratios), in log space; k and lambda by the advantage's sign. Detached: it scales
    the gradient of -A log p."""
    lower = math.log(1e-8)
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(nonneg, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(coef_1, advantages, per_token_logps, log_ratio, mask, settings):
    """-phi A log p, phi the sequence's detached gamma weight."""
    return -gamma_weights(advantages, log_ratio, mask, settings) * advantages * per_token_logps


def token_mean(values: torch.Tensor) -> float:
    """TRL's masked mean: 0 over no tokens."""
    return float(values.sum() / max(values.numel(), 1))


def sequence_flag_means(flags: torch.Tensor, lengths: list[int], level: str) -> list[float]:
    """Each sequence's mean flag. A masked (empty) sequence: at token level 0/0, which TRL's
    nanmin / nanmax leave out; at sequence level its ratio exp(0) = 1, never clipped."""
    flat = flags.float()
    means, start = [], 0
    for n in lengths:
        if n:
            means.append(float(flat[start : start + n].mean()))
        elif level == "sequence":
            means.append(0.0)
        start += n
    return means or [float("nan")]


def clip_mean(flags: torch.Tensor, lengths: list[int], level: str) -> float:
    """TRL's mean of a clip flag: over tokens, or over sequences when the ratio is the
    sequence's."""
    if level == "token":
        return token_mean(flags.float())
    per_sequence = sequence_flag_means(flags, lengths, "sequence")
    return sum(per_sequence) / len(per_sequence)


def clip_figures(ratio, advantages, lengths, settings) -> dict[str, float]:
    """TRL's clip_ratio/*: the share of ratios below 1 - epsilon on negative advantages, above
    1 + epsilon_high on positive ones, either, and the extreme sequences' shares."""
    per_token_adv = advantages.repeat_interleave(torch.tensor(lengths))
    level = settings.importance_sampling_level
    low = (ratio < 1 - settings.epsilon) & (per_token_adv < 0)
    up = (ratio > 1 + upper_clip(settings)) & (per_token_adv > 0)
    return {
        "clip_ratio/low_mean": clip_mean(low, lengths, level),
        "clip_ratio/high_mean": clip_mean(up, lengths, level),
        "clip_ratio/region_mean": clip_mean(low | up, lengths, level),
        "clip_ratio/low_min": min(sequence_flag_means(low, lengths, level)),
        "clip_ratio/high_max": max(sequence_flag_means(up, lengths, level)),
    }


def cispo_figures(ratio, advantages, lengths, settings) -> dict[str, float]:
    """TRL's cispo_clip_ratio: the share of ratios above epsilon_high on positive advantages."""
    per_token_adv = advantages.repeat_interleave(torch.tensor(lengths))
    clipped = (ratio > upper_clip(settings)) & (per_token_adv > 0)
    return {"cispo_clip_ratio": clip_mean(clipped, lengths, settings.importance_sampling_level)}


def vespo_figures(ratio, advantages, lengths, settings) -> dict[str, float]:
    """TRL's mean of the sequences' weights, from the token log-ratios log(ratio) (at sequence
    level each token holds the sequence's mean: their sum is the same)."""
    log_ratio = padded(ratio.log(), lengths)
    mask = padded(torch.ones_like(ratio), lengths)
    phi = gamma_weights(advantages.float()[:, None], log_ratio, mask, settings)
    return {"vespo/phi_seq_mean": float(phi.mean())}


def sum_then_scale_nll(hidden, weight, targets, advantages, token_weights, lengths):
    """Arm 1's loss, -(1/G) sum_i A_i (sum_t log pi(y_it)), in the seed's order: each
    completion's NLL summed, then scaled by its advantage A_i [G], summed and divided by G."""
    loss = weighted_token_nll(
        hidden, weight, targets, advantages.to(hidden.device), sequence_lengths=lengths
    )
    return loss / len(lengths)


def token_weighted_nll(hidden, weight, targets, advantages, token_weights, lengths):
    """The token-weighted loss: token t of completion i weighted by w_it / G (``token_weights``,
    one [L_i] tensor per completion; w_it = A_i s_i on flat steps)."""
    weights = torch.cat(token_weights).to(hidden.device) / len(lengths)
    return weighted_token_nll(hidden, weight, targets, weights)


def no_figures(ratio, advantages, lengths, settings) -> dict[str, float]:
    return {}


CLIP_RATIO_METRICS = {
    "clip_ratio/low_mean": 0.0,
    "clip_ratio/high_mean": 0.0,
    "clip_ratio/region_mean": 0.0,
    "clip_ratio/low_min": 0.0,
    "clip_ratio/high_max": 0.0,
}


@dataclass(frozen=True)
class LossType:
    """One loss type in one loss order (module docstring). ``objective(coef_1, advantages,
    per_token_logps, log_ratio, mask, settings)`` -> per-token loss [S, T] (TRL's types);
    ``study_loss(hidden [N, H], lm_head weight, targets [N], advantages [G], token_weights,
    lengths)`` -> the loss of a group through ``weighted_token_nll`` (the study's sum, in
    ``order``); ``reads``: the shared ``PolicyLossSettings`` fields it reads, ``requires`` those
    that must be set; ``settings``: its own settings (``own_setting``), which
    ``PolicyLossSettings`` holds after the shared ones; ``figures(ratio [N], advantages [S], lengths, settings)`` -> its figures
    of one micro-batch; ``metrics``: the names TRL logs for it, each with the value logged on a
    step without it (a study step clips nothing: 0)."""

    name: str
    objective: Callable | None
    normaliser: Normaliser
    order: str = "token_weighted"
    study_loss: Callable | None = None
    reads: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    settings: tuple[tuple, ...] = ()
    figures: Callable = no_figures
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """Through the fused policy loss (TRL's types), not ``weighted_token_nll`` (the study's)."""
        return self.objective is not None


LOSS_TYPES: dict[tuple[str, str], LossType] = {}  # by (loss type, loss order)


def own_setting(name: str, hint, default, help: str, check=None, error: str = "", trl=True):
    """A setting a loss type reads of its own: (name, type, field) of ``PolicyLossSettings``,
    among the settings of the ratio's term; ``trl``: TRL's GRPOConfig field of the same name
    (``rlvr_fast.utils.settings``)."""
    return (name, hint, setting(default, help, check, error, trl=trl or None, part="ratio"))


def sapo_setting(sign: str, default: float):
    return own_setting(
        f"sapo_temperature_{sign}",
        float,
        default,
        f"sapo's gate temperature of {'positive' if sign == 'pos' else 'negative'} advantages",
        lambda v: v > 0,
        "sapo temperatures must be > 0",
    )


def vespo_setting(name: str, default: float, what: str):
    """One of VESPO's gamma weight parameters (TRL's ``vespo_*``)."""
    return own_setting(
        name,
        float,
        default,
        f"vespo's gamma {what}",
        math.isfinite,
        "vespo's k and lambda must be finite numbers, got {value}",
    )


def register(loss: LossType) -> LossType:
    if (loss.name, loss.order) in LOSS_TYPES:
        raise ValueError(f"loss type {loss.name!r} is registered twice in order {loss.order}")
    if loss.fused == (loss.study_loss is not None):
        raise ValueError(f"loss type {loss.name!r} needs an objective or a study loss, not both")
    LOSS_TYPES[loss.name, loss.order] = loss
    return loss


CLIPPED = dict(
    objective=clipped_objective,
    reads=("epsilon", "epsilon_high", "delta"),
    figures=clip_figures,
    metrics=CLIP_RATIO_METRICS,
)
STUDY_SUM = dict(objective=None, normaliser=GROUP_SIZE, metrics=CLIP_RATIO_METRICS)
register(LossType("sum", order="sum_then_scale", study_loss=sum_then_scale_nll, **STUDY_SUM))
register(LossType("sum", order="token_weighted", study_loss=token_weighted_nll, **STUDY_SUM))
register(LossType("grpo", normaliser=SEQUENCE_MEANS, **CLIPPED))
register(LossType("bnpo", normaliser=MICRO_BATCH_TOKENS, **CLIPPED))
register(LossType("dr_grpo", normaliser=MAX_LENGTH, requires=("max_completion_length",), **CLIPPED))
register(LossType("dapo", normaliser=GENERATION_TOKENS, **CLIPPED))
register(LossType("luspo", normaliser=SEQUENCE_SUMS, **CLIPPED))
register(
    LossType(
        "cispo",
        cispo_objective,
        GENERATION_TOKENS,
        reads=("epsilon", "epsilon_high"),
        figures=cispo_figures,
        metrics={"cispo_clip_ratio": 0.0},
    )
)
register(
    LossType(
        "sapo",
        sapo_objective,
        SEQUENCE_MEANS,
        settings=(sapo_setting("pos", 1.0), sapo_setting("neg", 1.05)),
    )
)
register(
    LossType(
        "vespo",
        vespo_objective,
        GENERATION_TOKENS,
        settings=(
            vespo_setting("vespo_k_pos", 2.0, "shape k of positive advantages"),
            vespo_setting("vespo_lambda_pos", 3.0, "rate lambda of positive advantages"),
            vespo_setting("vespo_k_neg", 3.0, "shape k of negative advantages"),
            vespo_setting("vespo_lambda_neg", 2.0, "rate lambda of negative advantages"),
        ),
        figures=vespo_figures,
        metrics={"vespo/phi_seq_mean": None},
    )
)

# The names, in registration order: every loss type, and TRL's (through the fused policy loss);
# the loss orders (the study's sum is computed in either).
LOSS_TYPE_NAMES = tuple(dict.fromkeys(name for name, _ in LOSS_TYPES))
FUSED_LOSS_TYPE_NAMES = tuple(
    dict.fromkeys(name for (name, _), loss in LOSS_TYPES.items() if loss.fused)
)
LOSS_ORDERS = tuple(dict.fromkeys(order for _, order in LOSS_TYPES))
# Every loss type's own settings, in registration order: fields of PolicyLossSettings.
LOSS_TYPE_SETTINGS = tuple(s for loss in LOSS_TYPES.values() for s in loss.settings)
# Every loss type's own figures, ledger and TRL names alike.
LOSS_TYPE_FIGURES = tuple(dict.fromkeys(m for loss in LOSS_TYPES.values() for m in loss.metrics))


def loss_type(name: str, *, fused: bool = False, order: str | None = None) -> LossType:
    """The record of loss type ``name`` (``fused``: one of TRL's, through the fused policy loss)
    in loss order ``order`` (None: its first; what a loss type is beyond its loss is the same in
    every order); an unknown name is a one-line ValueError naming the known ones."""
    names = FUSED_LOSS_TYPE_NAMES if fused else LOSS_TYPE_NAMES
    if name not in names:
        raise ValueError(f"loss_type must be one of {', '.join(names)}, got {name!r}")
    orders = [loss for (known, _), loss in LOSS_TYPES.items() if known == name]
    if order is None:
        return orders[0]
    for loss in orders:
        if loss.order == order:
            return loss
    raise ValueError(
        f"loss_type {name} is computed in loss_order {', '.join(o.order for o in orders)}, "
        f"got {order!r}"
    )
