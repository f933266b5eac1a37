"""fused_policy_loss against TRL 1.16 itself: ``GRPOTrainer._compute_loss`` run on a stand-in
trainer whose log-probabilities are the fused op's, and TRL's ``entropy_from_logits``."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlvr_fast.ops.policy_loss import PolicyLossSettings, fused_policy_loss, padded

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
]


class SingleProcess:
    num_processes, sync_gradients = 1, True

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction):
        return tensor


def trl_loss(settings, logprobs, entropy, old, ref, advantages):
    """TRL's loss of per-token log-probabilities ``logprobs`` [N] (a leaf), its own code."""
    mask = padded(torch.ones_like(old), LENGTHS)
    args = SimpleNamespace(
        use_bias_correction_kl=settings.use_bias_correction_kl,
        delta=settings.delta,
        sapo_temperature_pos=settings.sapo_temperature_pos,
        sapo_temperature_neg=settings.sapo_temperature_neg,
        steps_per_generation=settings.gradient_accumulation_steps,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            padded(logprobs, LENGTHS),
            padded(entropy, LENGTHS),
            None,
        ),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=settings.importance_sampling_level,
        beta=settings.beta,
        loss_type=settings.loss_type,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon if settings.epsilon_high is None else settings.epsilon_high,
        max_completion_length=settings.max_completion_length,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=settings.gradient_accumulation_steps,
        accelerator=SingleProcess(),
        args=args,
        _metrics=defaultdict(lambda: defaultdict(list)),
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


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.loss_type}-{s.beta}-{s.delta}")
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
    leaf = stats.logprobs.clone().requires_grad_()
    expected, metrics = trl_loss(settings, leaf, stats.entropy, old, ref, advantages)
    (grad_logprobs,) = torch.autograd.grad(expected, leaf)
    # TRL's gradient through the eager log-softmax of the same logits, chained by autograd.
    eager = torch.log_softmax((hidden @ weight.T) / 0.7, -1).gather(1, targets[:, None])
    (grad_trl,) = torch.autograd.grad(eager.squeeze(1), hidden, grad_logprobs)
    torch.testing.assert_close(fused, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_fused, grad_trl, rtol=1e-5, atol=1e-7)
    entropy = trl_utils.entropy_from_logits(logits)
    torch.testing.assert_close(stats.entropy, entropy, rtol=1e-5, atol=1e-6)
    assert metrics["entropy"] == pytest.approx([float(entropy.mean())], rel=1e-5)
