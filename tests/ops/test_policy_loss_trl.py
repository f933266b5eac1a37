"""fused_policy_loss against TRL 1.16 itself: ``GRPOTrainer._compute_loss`` run on a stand-in
trainer whose log-probabilities are the fused op's, and TRL's ``entropy_from_logits``."""

from __future__ import annotations

import functools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlvr_fast.ops.loss_types import padded
from rlvr_fast.ops.policy_loss import PolicyLossSettings, fused_policy_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

LENGTHS, MAX_COMPLETION = [5, 1, 9, 4], 12
SETTINGS = [
    PolicyLossSettings(loss_type=loss_type, max_completion_length=MAX_COMPLETION)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
] + [
    PolicyLossSettings(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    PolicyLossSettings(loss_type="dapo", epsilon_high=0.28, beta=0.1, use_bias_correction_kl=True),
    PolicyLossSettings(loss_type="cispo", epsilon_high=1.1, delta=1.5, beta=0.02),
    PolicyLossSettings(loss_type="bnpo", delta=1.2, gradient_accumulation_steps=2),
    PolicyLossSettings(loss_type="dapo", entropy_coef=0.01),
    PolicyLossSettings(loss_type="grpo", top_entropy_quantile=0.2),
    PolicyLossSettings(loss_type="dapo", top_entropy_quantile=0.2, entropy_coef=0.01),
    PolicyLossSettings(loss_type="bnpo", off_policy_mask_threshold=0.05, entropy_coef=0.1),
    PolicyLossSettings(loss_type="vespo"),
    PolicyLossSettings(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=0.5, beta=0.04),
]


class SingleProcess:
    num_processes, sync_gradients = 1, True

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction):
        return tensor

    def pad_across_processes(self, tensor, dim, pad_index):
        return tensor


def trl_loss(settings, logprobs, entropy, old, ref, advantages):
    """TRL's loss of per-token log-probabilities ``logprobs`` [N] (a leaf), its own code."""
    mask = padded(torch.ones_like(old), LENGTHS)
    args = SimpleNamespace(
        use_bias_correction_kl=settings.use_bias_correction_kl,
        delta=settings.delta,
        sapo_temperature_pos=settings.sapo_temperature_pos,
        sapo_temperature_neg=settings.sapo_temperature_neg,
        vespo_k_pos=settings.vespo_k_pos,
        vespo_lambda_pos=settings.vespo_lambda_pos,
        vespo_k_neg=settings.vespo_k_neg,
        vespo_lambda_neg=settings.vespo_lambda_neg,
        steps_per_generation=settings.gradient_accumulation_steps,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            padded(logprobs, LENGTHS),
            padded(entropy, LENGTHS),
            None,
        ),
        top_entropy_quantile=settings.top_entropy_quantile,
        off_policy_mask_threshold=settings.off_policy_mask_threshold,
        get_off_policy_mask=trl_grpo.GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=trl_grpo.GRPOTrainer.get_gamma_weights,
        entropy_coef=settings.entropy_coef,
        use_adaptive_entropy=False,
        _entropy_bonus_enabled=settings.entropy_coef != 0.0,
        importance_sampling_level=settings.importance_sampling_level,
        beta=settings.beta,
        loss_type=settings.loss_type,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon if settings.epsilon_high is None else settings.epsilon_high,
        max_completion_length=settings.max_completion_length,
        use_vllm=False,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=settings.gradient_accumulation_steps,
        accelerator=SingleProcess(),
        args=args,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    trainer.get_high_entropy_mask = functools.partial(
        trl_grpo.GRPOTrainer.get_high_entropy_mask, trainer
    )
    inputs = dict(
        prompt_ids=torch.zeros(len(LENGTHS), 1, dtype=torch.long),
        prompt_mask=torch.ones(len(LENGTHS), 1, dtype=torch.long),
        completion_ids=torch.zeros(mask.shape, dtype=torch.long),
        completion_mask=mask,
        advantages=advantages,
        old_per_token_logps=padded(old, LENGTHS),
        ref_per_token_logps=padded(ref, LENGTHS),
        num_items_in_batch=torch.tensor(float(sum(LENGTHS))),
    )
    return trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


@pytest.mark.parametrize(
    "settings",
    SETTINGS,
    ids=lambda s: f"{s.loss_type}-{s.beta}-{s.delta}-{s.entropy_coef}-{s.top_entropy_quantile}",
)
def test_loss_gradient_and_entropy_equal_trls(settings):
    generator = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    hidden = torch.randn(n, 32, generator=generator).requires_grad_()
    weight = torch.randn(200, 32, generator=generator) / 32**0.5
    targets = torch.randint(0, 200, (n,), generator=generator)
    logits = hidden.detach() @ weight.T / 0.7
    exact = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    old, ref = exact + 0.3 * torch.randn(2, n, generator=generator)
    advantages = torch.randn(len(LENGTHS), generator=generator)
    fused, stats = fused_policy_loss(
        hidden, weight, targets, old, advantages, LENGTHS, settings,
        ref_logprobs=ref, temperature=0.7, chunk_size=7,
    )  # fmt: skip
    (grad_fused,) = torch.autograd.grad(fused, hidden)
    leaves = stats.logprobs.clone().requires_grad_(), stats.entropy.clone().requires_grad_()
    expected, metrics = trl_loss(settings, *leaves, old, ref, advantages)
    grad_logprobs, grad_entropy = torch.autograd.grad(expected, leaves, allow_unused=True)
    # TRL's gradient through the eager log-softmax of the same logits, chained by autograd.
    eager_logp = torch.log_softmax((hidden @ weight.T) / 0.7, -1)
    eager = eager_logp.gather(1, targets[:, None]).squeeze(1)
    eager_entropy = -(eager_logp.exp() * eager_logp).sum(-1)
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(eager_entropy)
    (grad_trl,) = torch.autograd.grad((eager, eager_entropy), hidden, (grad_logprobs, grad_entropy))
    torch.testing.assert_close(fused, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_fused, grad_trl, rtol=1e-5, atol=1e-7)
    entropy = trl_utils.entropy_from_logits(logits)
    torch.testing.assert_close(stats.entropy, entropy, rtol=1e-5, atol=1e-6)
    assert metrics["entropy"] == pytest.approx([float(entropy.mean())], rel=1e-5)
