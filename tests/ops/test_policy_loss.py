"""fused_policy_loss against the fp32 eager reference: row statistics (log p, entropy at a
temperature), the loss and its gradients for every loss type, both importance-sampling levels
and the KL term, both backends."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE, on_device
from rlvr_fast.kernels.policy_loss import (
    policy_rows_stats_torch,
    policy_rows_stats_triton,
    token_stats_reference,
)
from rlvr_fast.ops.loss_types import FUSED_LOSS_TYPE_NAMES
from rlvr_fast.ops.policy_loss import PolicyLossSettings, fused_policy_loss, policy_objective

BACKENDS = ["torch", "triton"] if DEVICE == "cpu" else ["triton"]
ROW_STATS = {"torch": policy_rows_stats_torch, "triton": policy_rows_stats_triton}
LENGTHS = [5, 1, 9, 0, 4]


def make_inputs(lengths, h, v, seed=0):
    n = sum(lengths)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator)
    weight = torch.randn(v, h, generator=generator) / h**0.5
    targets = torch.randint(0, v, (n,), generator=generator)
    with torch.no_grad():
        exact, _ = token_stats_reference(hidden, weight, targets, 1.0)
    # Old and reference log-probabilities near the current ones, so ratios straddle the clips.
    old = exact + 0.3 * torch.randn(n, generator=generator)
    ref = exact + 0.3 * torch.randn(n, generator=generator)
    advantages = torch.randn(len(lengths), generator=generator)
    return [t.to(DEVICE) for t in (hidden, weight, targets, old, ref, advantages)]


def reference_loss(hidden, weight, targets, old, ref, advantages, lengths, settings, temperature):
    logprobs, entropy = token_stats_reference(hidden, weight, targets, temperature)
    loss, *figures = policy_objective(
        logprobs, old, advantages, lengths, settings, ref, entropy=entropy
    )
    return loss, (logprobs.detach(), entropy.detach(), *figures)


def loss_and_grads(fn, hidden, weight, dtype):
    h = hidden.detach().to(dtype).clone().requires_grad_()
    w = weight.detach().to(dtype).clone().requires_grad_()
    loss, stats = fn(h, w)
    loss.backward()
    return (loss.detach().float(), h.grad.float(), w.grad.float()), stats


def rel_err(got, expected):
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,vocab", [(1, 77), (7, 1000), (3, 5003)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_stats_match_the_reference(backend, rows, vocab, temperature):
    generator = torch.Generator().manual_seed(rows)
    logits = (4 * torch.randn(rows, vocab, generator=generator)).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), generator=generator).to(DEVICE)
    identity = torch.eye(vocab, device=DEVICE)
    expected = token_stats_reference(logits, identity, targets, temperature)
    logprobs, lse, entropy = ROW_STATS[backend](logits.clone(), targets, temperature)
    torch.testing.assert_close(logprobs, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits / temperature, -1), rtol=1e-6, atol=1e-5)


SETTINGS = [
    PolicyLossSettings(loss_type=loss_type, max_completion_length=12)
    for loss_type in FUSED_LOSS_TYPE_NAMES
] + [
    PolicyLossSettings(importance_sampling_level="sequence", loss_type="grpo"),
    PolicyLossSettings(epsilon=0.1, epsilon_high=0.28, beta=0.04, loss_type="bnpo"),
    PolicyLossSettings(loss_type="cispo", epsilon_high=1.1, beta=0.1, use_bias_correction_kl=True),
    PolicyLossSettings(delta=1.2, num_items_in_batch=30, gradient_accumulation_steps=2),
    # The entropy's own gradient: the bonus alone, over the top-entropy tokens, with the KL.
    PolicyLossSettings(loss_type="grpo", entropy_coef=0.5),
    PolicyLossSettings(top_entropy_quantile=0.3, entropy_coef=0.05, gradient_accumulation_steps=3),
    PolicyLossSettings(loss_type="bnpo", top_entropy_quantile=0.5, beta=0.04),
    PolicyLossSettings(
        loss_type="dr_grpo", max_completion_length=12, off_policy_mask_threshold=0.1
    ),
]


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "settings",
    SETTINGS,
    ids=lambda s: f"{s.loss_type}-{s.beta}-{s.delta}-{s.entropy_coef}-{s.top_entropy_quantile}",
)
def test_fp32_loss_grads_and_stats_match_reference(backend, settings):
    hidden, weight, targets, old, ref, advantages = make_inputs(LENGTHS, 32, 300)
    common = (targets, old, ref, advantages, LENGTHS, settings, 0.7)
    expected, expected_stats = loss_and_grads(
        lambda h, w: reference_loss(h, w, *common), hidden, weight, torch.float32
    )

    def fused(h, w):
        return fused_policy_loss(
            h, w, targets, old, advantages, LENGTHS, settings,
            ref_logprobs=ref, temperature=0.7, chunk_size=6, backend=backend,
        )  # fmt: skip

    got, stats = loss_and_grads(fused, hidden, weight, torch.float32)
    for name, value, want in zip(("loss", "dhidden", "dweight"), got, expected):
        assert rel_err(value, want) <= 1e-5, name
    for name, value, want in zip(stats._fields, stats, expected_stats):
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "settings",
    [
        PolicyLossSettings(loss_type="dapo", beta=0.04, epsilon_high=0.28),
        PolicyLossSettings(loss_type="cispo", beta=0.04, epsilon_high=0.28),
        PolicyLossSettings(loss_type="grpo", entropy_coef=0.3, top_entropy_quantile=0.5),
    ],
    ids=["dapo", "cispo", "grpo-entropy"],
)
def test_bf16_error_at_most_twice_eager_bf16(backend, settings):
    hidden, weight, targets, old, ref, advantages = make_inputs(LENGTHS, 64, 1000, seed=1)
    common = (targets, old, ref, advantages, LENGTHS, settings, 1.0)
    exact, _ = loss_and_grads(
        lambda h, w: reference_loss(h, w, *common), hidden, weight, torch.float32
    )
    eager, _ = loss_and_grads(
        lambda h, w: reference_loss(h, w, *common), hidden, weight, torch.bfloat16
    )

    def fused(h, w):
        return fused_policy_loss(
            h, w, targets, old, advantages, LENGTHS, settings,
            ref_logprobs=ref, chunk_size=5, backend=backend,
        )  # fmt: skip

    got, _ = loss_and_grads(fused, hidden, weight, torch.bfloat16)
    for name, value, base, want in zip(("loss", "dhidden", "dweight"), got, eager, exact):
        assert rel_err(value, want) <= 2 * rel_err(base, want) + 1e-6, name


@on_device
def test_no_grad_mode_returns_the_loss_and_stats():
    hidden, weight, targets, old, ref, advantages = make_inputs(LENGTHS, 32, 100, seed=2)
    settings = PolicyLossSettings(beta=0.04)
    with torch.no_grad():
        loss, stats = fused_policy_loss(
            hidden, weight, targets, old, advantages, LENGTHS, settings, ref_logprobs=ref
        )
        expected, expected_stats = reference_loss(
            hidden, weight, targets, old, ref, advantages, LENGTHS, settings, 1.0
        )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.entropy, expected_stats[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(sequence_lengths=[1, 2]), "sum to N"),
        (dict(advantages=torch.zeros(2)), "advantages"),
        (dict(settings=PolicyLossSettings(beta=0.1)), "ref_logprobs"),
        (dict(temperature=0.0), "temperature"),
        (dict(targets=torch.full((19,), 100)), "targets must lie in"),
    ],
)
def test_bad_inputs_are_clear_errors(change, message):
    hidden, weight, targets, old, _, advantages = make_inputs(LENGTHS, 32, 100)
    arguments = dict(
        targets=targets, old_logprobs=old, advantages=advantages, sequence_lengths=LENGTHS
    )
    with pytest.raises(ValueError, match=message):
        fused_policy_loss(hidden, weight, **{**arguments, **change})


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(loss_type="ppo"), "loss_type must be"),
        (dict(importance_sampling_level="batch"), "importance_sampling_level"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
    ],
)
def test_bad_settings_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossSettings(**fields)
