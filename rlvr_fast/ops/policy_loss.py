"""``fused_policy_loss``: TRL's GRPO policy loss from hidden states and the LM head, chunked.

Never materialises [tokens, vocab]. Pass 1 walks the tokens in chunks: cuBLAS forms a chunk's
logits tile, the row kernel (``rlvr_fast.kernels.policy_loss``) reads it once for log p_t, the
log-sum-exp and the entropy at the sampling temperature, and the tile is dropped. The loss is
then a function of [N] vectors only, the log-probabilities and the entropies
(``policy_objective``: TRL 1.16's formulas, on the [S, T] padded layout TRL uses, with its
high-entropy token mask, off-policy sequence mask and entropy bonus), so its gradients g = dL /
d log p and g^H = dL / d entropy come from autograd over [N] values, whatever the loss type or
importance-sampling level (a sequence-level ratio or an entropy quantile needs every token of
the call before any gradient is known, which is why the gradient waits for pass 1). Pass
2 recomputes each tile, turns it in place into the logit gradient and runs the two backward
GEMMs, dW accumulated in fp32 by the GEMM (``weighted_nll.accumulate_grad_weight``). The price of
generality is one more logits GEMM per chunk than ``weighted_token_nll`` (4 GEMMs, not 3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlvr_fast.ops import launch
from rlvr_fast.ops.loss_types import LOSS_TYPE_SETTINGS, loss_type, padded, unpadded
from rlvr_fast.kernels.policy_loss import (
    policy_rows_grad_torch,
    policy_rows_grad_triton,
    policy_rows_stats_torch,
    policy_rows_stats_triton,
)
from rlvr_fast.utils.settings import check_settings, must_be_one_of, one_of, setting
from rlvr_fast.ops.weighted_nll import (
    accumulate_grad_weight,
    check_target_range,
    default_chunk_size,
)

IS_LEVELS = ("token", "sequence")
BACKENDS = {
    "torch": (policy_rows_stats_torch, policy_rows_grad_torch),
    "triton": (policy_rows_stats_triton, policy_rows_grad_triton),
}


@dataclass(frozen=True)
class SharedPolicyLossSettings:
    """TRL 1.16 GRPOConfig's loss fields, with its names and defaults; ``loss_type`` names a
    fused record of ``rlvr_fast.ops.loss_types``. These are the settings every loss type may
    read; ``PolicyLossSettings`` adds each loss type's own (its record's ``settings``). Each
    field declared by ``setting`` is a setting of a run, declared here once (default, help,
    checks): ``TrainConfig``'s field
    (``rlvr_fast.train.policy_config``), the facade's ``GRPOConfig`` field and its line of
    ``support.HONOURED`` are derived from it. The other fields are values of one call:
    ``num_items_in_batch`` normalises dapo, cispo and vespo (TRL: the generation batch's
    completion tokens, rescaled to one accumulation window; default here: this call's tokens);
    ``max_completion_length`` normalises dr_grpo; ``gradient_accumulation_steps`` divides the
    other types, as TRL does in training; ``loss_type`` is the run's own setting (its default
    there is the study's sum)."""

    loss_type: str = "dapo"
    beta: float = setting(
        0.0,
        "TRL's beta: weight of the k3 KL to a frozen reference model (bf16 on CUDA), fused with "
        "the loss; > 0 makes every group contribute",
        lambda v: v >= 0,
        "{name} must be >= 0, got {value}",
        trl=True,
        run_name="kl_beta",
        part="kl",
    )
    use_bias_correction_kl: bool = setting(
        False, "TRL's importance-weighted KL estimate", part="kl"
    )
    importance_sampling_level: str = setting(
        "token",
        "the importance ratio per token, or per sequence (GSPO)",
        one_of(IS_LEVELS),
        must_be_one_of("importance_sampling_level", IS_LEVELS),
        trl=True,
        part="ratio",
    )
    epsilon: float = setting(
        0.2,
        "lower clip of the ratio, 1 - epsilon",
        lambda v: v >= 0,
        "epsilon must be >= 0, got {value}",
        trl=True,
        part="ratio",
    )
    epsilon_high: float | None = setting(
        None,
        "upper clip of the ratio, 1 + epsilon_high (None: epsilon); cispo's clip",
        lambda v: v is None or v >= 0,
        "epsilon_high must be >= 0 or None, got {value}",
        trl=True,
        part="ratio",
    )
    delta: float | None = setting(
        None,
        "two-sided clip: the ratio capped at delta (None: none)",
        lambda v: v is None or v > 0,
        "delta must be > 0 or None, got {value}",
        trl=True,
        part="ratio",
    )
    max_completion_length: int | None = None
    num_items_in_batch: float | None = None
    gradient_accumulation_steps: int = 1
    top_entropy_quantile: float = setting(
        1.0,
        "TRL's top_entropy_quantile (rho): the policy term keeps only the tokens whose entropy is "
        "at least the 1 - rho quantile of the step's (1: every token)",
        lambda v: 0 <= v <= 1,
        "top_entropy_quantile must be in [0, 1], got {value}",
        trl=True,
        part="entropy",
    )
    # TRL's bonus at coefficient 0 (its adaptive control's) subtracts 0: the same loss.
    entropy_coef: float = setting(
        0.0,
        "TRL's entropy bonus: the loss minus this times the mean entropy of the policy term's "
        "tokens (every group then contributes); the initial coefficient of use_adaptive_entropy",
        trl=True,
        part="entropy",
    )
    off_policy_mask_threshold: float | None = setting(
        None,
        "TRL's off-policy sequence mask (DeepSeek-V3.2's OPSM): a sequence of negative advantage "
        "whose mean KL(old || current) exceeds this leaves the policy term (None: none)",
        trl=True,
        part="mask",
    )

    def __post_init__(self):
        check_settings(self)
        loss = loss_type(self.loss_type, fused=True)
        for name in loss.requires:
            if getattr(self, name) is None:
                raise ValueError(f"loss_type {self.loss_type} needs {name}")


PolicyLossSettings = dataclasses.make_dataclass(
    "PolicyLossSettings",
    LOSS_TYPE_SETTINGS,
    bases=(SharedPolicyLossSettings,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "The fused policy loss's settings: the shared ones and every loss type's own.",
    },
)
DEFAULT_SETTINGS = PolicyLossSettings()


class PolicyLossStats(NamedTuple):
    """Detached per-token figures [N] (fp32): log p at the temperature, the entropy of the
    token's distribution, the importance ratio (the sequence's on every token of it when
    sequence-level), the KL estimate (zeros when beta = 0) and TRL's high-entropy mask (ones
    when top_entropy_quantile = 1; None: no loss was measured)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor
    entropy_mask: torch.Tensor | None = None


def policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    lengths: list[int],
    settings: PolicyLossSettings,
    ref_logprobs: torch.Tensor | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` after the log-probabilities, on [N] tokens of S
    sequences (``lengths``) laid out as TRL's [S, T] with its mask, as one micro-batch: returns
    (loss, ratio [N], kl [N], entropy mask [N]). ``advantages`` is [S]; ``old_logprobs`` None is
    TRL's on-policy case (one update per generation), where the old log-probabilities are the
    current ones, detached. ``entropy`` [N] (needed by top_entropy_quantile < 1 and the entropy
    bonus, differentiable for the bonus) gives TRL's high-entropy mask and the bonus."""
    if entropy is None and (settings.entropy_coef != 0.0 or settings.top_entropy_quantile < 1.0):
        raise ValueError("the entropy bonus and top_entropy_quantile < 1 need entropy [N]")
    per_token_logps, mask = padded(logprobs, lengths), padded(torch.ones_like(logprobs), lengths)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = per_token_logps - padded(old, lengths)
    if settings.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.zeros_like(per_token_logps)
    if settings.beta != 0.0:
        ref = padded(ref_logprobs, lengths)
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    advantages = advantages.float()[:, None]
    loss_of = loss_type(settings.loss_type, fused=True)
    per_token_loss = loss_of.objective(
        coef_1, advantages, per_token_logps, log_ratio, mask, settings
    )
    if settings.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask(
            advantages, log_ratio.detach(), mask, settings.off_policy_mask_threshold
        )
    entropies = None if entropy is None else padded(entropy, lengths)
    entropy_mask = mask
    if settings.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(entropies, mask, 1 - settings.top_entropy_quantile)
        per_token_loss = per_token_loss * entropy_mask
    if settings.beta != 0.0:
        per_token_loss = per_token_loss + settings.beta * per_token_kl
    loss = loss_of.normaliser.aggregate(per_token_loss, mask, settings)
    if settings.entropy_coef != 0.0:
        # TRL's bonus: the mean entropy over the tokens of the policy term, scaled for
        # gradient accumulation only, whatever the loss type's normaliser.
        effective_mask = mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
        loss = loss - settings.entropy_coef * entropy_loss / settings.gradient_accumulation_steps
    ratio = unpadded(coef_1.expand_as(mask), lengths).detach()
    kept = unpadded(entropy_mask, lengths).detach()
    return loss, ratio, unpadded(per_token_kl, lengths).detach(), kept


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float):
    """TRL's ``get_high_entropy_mask`` on one process, as a float [S, T] mask: the valid tokens
    whose entropy is at least the ``threshold`` quantile of the valid tokens' entropies."""
    valid = entropies.detach()[mask.bool()].float()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    entropy_threshold = torch.quantile(valid, threshold)
    return ((entropies.detach() * mask >= entropy_threshold) & mask.bool()).to(mask.dtype)


def off_policy_mask(advantages, log_ratio, mask, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2's OPSM) [S, 1]: a sequence is kept when its
    advantage is >= 0 or its mean KL(old || current) estimate, mean(old - log p), is at most
    ``threshold``; the old log-probabilities are the sampling ones (no vLLM here)."""
    kl_div = torch.nan_to_num(-log_ratio, nan=0.0)
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(
        min=1.0
    )
    return ((advantages >= 0) | (avg_seq_kl <= threshold)).to(mask.dtype)


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, objective, temperature, chunk, backend, need_grad):
        ctx.weight_dtype = weight.dtype
        stats_fn, grad_fn = BACKENDS[backend]
        stats = torch.empty(3, hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = hidden[start:end] @ weight.T
            stats[:, start:end] = torch.stack(stats_fn(logits, targets[start:end], temperature))
            del logits  # else the next chunk's tile is allocated while this one is alive
        logprobs, lse, entropy = stats
        with torch.enable_grad():
            leaves = logprobs.clone().requires_grad_(), entropy.clone().requires_grad_()
            loss, *figures = objective(*leaves)
            grads = (None, None)
            if need_grad:  # g = dL / d log p and g^H = dL / d entropy (None: no entropy term)
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        grad_logprobs, grad_entropy = grads
        if grad_logprobs is None and need_grad:  # a loss of the entropy alone
            grad_logprobs = torch.zeros_like(logprobs)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        # A frozen head (LoRA) gets no dW: neither its fp32 [V, H] nor its GEMMs.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_grad and ctx.needs_input_grad[1]
            else None
        )
        for start in range(0, hidden.shape[0] if need_grad else 0, chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            logits = h @ weight.T  # [C, V], becomes the logit gradient in place
            grad_fn(
                logits,
                targets[start:end],
                lse[start:end],
                grad_logprobs[start:end],
                temperature,
                entropy[start:end],
                None if grad_entropy is None else grad_entropy[start:end],
            )
            torch.mm(logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                accumulate_grad_weight(grad_weight, logits, h)
            del logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        outputs = (logprobs, entropy, *figures)
        ctx.mark_non_differentiable(*outputs)
        return loss.detach(), *outputs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = grad_hidden * grad_loss  # in fp32: a loss scale of 2^16 is no fp16 number
        if ctx.needs_input_grad[1]:
            dw = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def fused_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    sequence_lengths: list[int],
    settings: PolicyLossSettings = DEFAULT_SETTINGS,
    *,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """TRL's GRPO loss (``policy_objective``) of the tokens ``targets`` [N] predicted by
    ``hidden`` [N, H] through ``weight`` [V, H] at ``temperature``: S sequences back to back
    (``sequence_lengths``), ``old_logprobs`` [N] (None: the current ones, detached) and, for
    beta > 0, ``ref_logprobs`` [N] (detached, at the same temperature), ``advantages`` [S].
    Returns the 0-dim fp32 loss,
    differentiable in hidden and weight, and the detached ``PolicyLossStats``."""
    num_tokens = hidden.shape[0]
    _check_inputs(hidden, weight, targets, old_logprobs, advantages, sequence_lengths)
    if settings.beta != 0.0 and (ref_logprobs is None or ref_logprobs.shape != (num_tokens,)):
        raise ValueError(f"beta > 0 needs ref_logprobs [N={num_tokens}]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    backend = backend or ("triton" if hidden.is_cuda else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    chunk = chunk_size or default_chunk_size(
        max(1, num_tokens), weight.shape[0], weight.element_size()
    )
    lengths = list(sequence_lengths)

    def objective(logprobs, entropy):
        return policy_objective(
            logprobs, old_logprobs, advantages, lengths, settings, ref_logprobs, entropy=entropy
        )

    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with launch.on_device(hidden):  # the gradients are computed here, in the forward
        loss, *stats = _FusedPolicyLoss.apply(
            hidden.contiguous(),
            weight.contiguous(),
            targets.contiguous(),
            objective,
            float(temperature),
            chunk,
            backend,
            need_grad,
        )
    return loss, PolicyLossStats(*stats)


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> PolicyLossStats:
    """Pass 1 of ``fused_policy_loss`` alone, without gradients: log p [N] at ``temperature``
    and the entropy [N] of ``targets`` [N] predicted by ``hidden`` [N, H] through ``weight``
    [V, H] (a reference model's log-probabilities, or the old ones of a generation); ratio ones
    and kl zeros."""
    num_tokens = hidden.shape[0]
    with torch.no_grad():
        _, stats = fused_policy_loss(
            hidden,
            weight,
            targets,
            None,
            torch.zeros(1, device=hidden.device),
            [num_tokens],
            temperature=temperature,
            chunk_size=chunk_size,
            backend=backend,
        )
    return stats


def _check_inputs(hidden, weight, targets, old_logprobs, advantages, lengths) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(
            f"hidden and weight need one floating dtype, got {hidden.dtype} and {weight.dtype}"
        )
    num_tokens = hidden.shape[0]
    if any(n < 0 for n in lengths) or sum(lengths) != num_tokens:
        raise ValueError(f"sequence_lengths must be >= 0 and sum to N={num_tokens}, got {lengths}")
    if targets.dtype != torch.int64 or targets.shape != (num_tokens,):
        raise ValueError(f"targets must be int64 [N={num_tokens}], got {targets.dtype}")
    old_shape = (num_tokens,) if old_logprobs is None else tuple(old_logprobs.shape)
    if old_shape != (num_tokens,) or advantages.shape != (len(lengths),):
        raise ValueError(
            f"old_logprobs must be [N={num_tokens}] and advantages [S={len(lengths)}], got "
            f"{old_shape} and {tuple(advantages.shape)}"
        )
    check_target_range(targets, weight.shape[0])
