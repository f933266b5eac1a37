"""weighted_token_nll against the fp32 eager reference: loss, dHidden, dWeight, both backends."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE, on_device
from rlvr_fast.kernels.weighted_nll import weighted_token_nll_reference
from rlvr_fast.ops import weighted_token_nll
from rlvr_fast.ops.weighted_nll import CHUNK_BYTES, accumulate_grad_weight, default_chunk_size

BACKENDS = ["torch", "triton"] if DEVICE == "cpu" else ["triton"]
SHAPES = [(n, h, v) for n in (1, 63, 500) for h in (64, 96) for v in (77, 1000)] + [
    (3, 64, 151_936),
    (2, 96, 151_936),
]


def make_inputs(n, h, v, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator)
    weight = torch.randn(v, h, generator=generator) / h**0.5
    targets = torch.randint(0, v, (n,), generator=generator)
    weights = torch.randn(n, generator=generator)
    weights[::4] = 0.0  # zero advantages, and randn gives negatives
    return [t.to(DEVICE) for t in (hidden, weight, targets, weights)]


def loss_and_grads(fn, hidden, weight, targets, weights, dtype):
    h = hidden.detach().to(dtype).clone().requires_grad_()
    w = weight.detach().to(dtype).clone().requires_grad_()
    loss = fn(h, w, targets, weights)
    loss.backward()
    return loss.detach().float(), h.grad.float(), w.grad.float()


def rel_err(got, expected):
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,h,v", SHAPES)
def test_fp32_matches_reference(backend, n, h, v):
    inputs = make_inputs(n, h, v)
    expected = loss_and_grads(weighted_token_nll_reference, *inputs, torch.float32)
    fused = loss_and_grads(
        lambda *a: weighted_token_nll(*a, chunk_size=37, backend=backend), *inputs, torch.float32
    )
    for got, want in zip(fused, expected):
        assert rel_err(got, want) <= 1e-5


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,h,v", [(63, 64, 1000), (500, 96, 77), (3, 64, 151_936)])
def test_bf16_error_at_most_twice_eager_bf16(backend, n, h, v):
    inputs = make_inputs(n, h, v, seed=1)
    exact = loss_and_grads(weighted_token_nll_reference, *inputs, torch.float32)
    eager = loss_and_grads(weighted_token_nll_reference, *inputs, torch.bfloat16)
    fused = loss_and_grads(
        lambda *a: weighted_token_nll(*a, chunk_size=29, backend=backend), *inputs, torch.bfloat16
    )
    for name, got, base, want in zip(("loss", "dhidden", "dweight"), fused, eager, exact):
        assert rel_err(got, want) <= 2 * rel_err(base, want) + 1e-6, name


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_and_chunking(backend):
    hidden, weight, targets, weights = make_inputs(50, 64, 300, seed=2)
    reference = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    results = [
        weighted_token_nll(
            hidden, weight, targets, weights, chunk_size=c, return_logprobs=True, backend=backend
        )
        for c in (1, 7, None)
    ]
    for loss, logprobs in results:
        assert not logprobs.requires_grad
        torch.testing.assert_close(logprobs, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)


@on_device
def test_gradient_for_hidden_only_and_no_grad_mode():
    hidden, weight, targets, weights = make_inputs(20, 64, 100, seed=3)
    h = hidden.clone().requires_grad_()
    weighted_token_nll(h, weight, targets, weights).backward()
    h_ref = hidden.clone().requires_grad_()
    weighted_token_nll_reference(h_ref, weight, targets, weights).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        loss = weighted_token_nll(hidden, weight, targets, weights)
    torch.testing.assert_close(loss, weighted_token_nll_reference(hidden, weight, targets, weights))


@on_device
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: (a[0][None], *a[1:]), "hidden must be"),
        (lambda a: (a[0][:, :10], *a[1:]), "hidden size mismatch"),
        (lambda a: (a[0].double(), *a[1:]), "one floating dtype"),
        (lambda a: (a[0], a[1], a[2].int(), a[3]), "targets must be int64"),
        (lambda a: (a[0], a[1], a[2] + 1000, a[3]), "targets must lie in"),
        (lambda a: (a[0], a[1], a[2] - 1000, a[3]), "targets must lie in"),
        (lambda a: (*a[:3], a[3][:-1]), "weights must be float"),
    ],
)
def test_bad_inputs_are_clear_errors(change, message):
    inputs = make_inputs(5, 64, 100)
    with pytest.raises(ValueError, match=message):
        weighted_token_nll(*change(inputs))


def sum_then_scale_reference(hidden, weight, targets, weights, lengths):
    """The eager sum-then-scale loss: fp32 NLLs in a zero-padded [S, max_len] table, each row
    summed, then scaled by its weight and summed."""
    logits = (hidden @ weight.T).float()
    nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    padded = torch.nn.utils.rnn.pad_sequence(list(nll.split(lengths)), batch_first=True)
    return (weights.float() * padded.sum(dim=1)).sum()


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_weights_sum_each_sequence_then_scale(backend, dtype):
    lengths = [7, 1, 0, 20, 3]
    hidden, weight, targets, _ = make_inputs(sum(lengths), 64, 300, seed=4)
    weights = torch.tensor([0.5, -1.5, 3.0, 0.0, -1.0], device=DEVICE)
    expected = loss_and_grads(
        lambda *a: sum_then_scale_reference(*a, lengths), hidden, weight, targets, weights, dtype
    )
    fused = loss_and_grads(
        lambda *a: weighted_token_nll(*a, sequence_lengths=lengths, chunk_size=6, backend=backend),
        *(hidden, weight, targets, weights),
        dtype,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(fused, expected):
        assert rel_err(got, want) <= tolerance
    per_token = weights.repeat_interleave(torch.tensor(lengths, device=DEVICE))
    token_grads = loss_and_grads(
        lambda *a: weighted_token_nll(*a, chunk_size=6, backend=backend),
        *(hidden, weight, targets, per_token),
        dtype,
    )
    # The order of the sums changes the loss's rounding, never the gradients.
    assert torch.equal(fused[1], token_grads[1]) and torch.equal(fused[2], token_grads[2])


@pytest.mark.parametrize(
    "tokens,vocab,element_size,expected",
    [(2048, 151_936, 4, 205), (2048, 151_936, 2, 410), (441, 151_936, 2, 441), (3, 10**9, 4, 1)],
)
def test_default_chunks_fill_the_tile_budget_evenly(tokens, vocab, element_size, expected):
    chunk = default_chunk_size(tokens, vocab, element_size)
    assert chunk == expected and chunk * vocab * element_size <= max(CHUNK_BYTES, vocab * 4)


def test_half_precision_grad_weight_accumulates_in_fp32_on_cpu():
    generator = torch.Generator().manual_seed(5)
    dlogits = torch.randn(9, 40, generator=generator).bfloat16()
    h = torch.randn(9, 16, generator=generator).bfloat16()
    grad_weight = torch.randn(40, 16, generator=generator)
    expected = grad_weight + dlogits.double().T @ h.double()
    accumulate_grad_weight(grad_weight, dlogits, h)
    torch.testing.assert_close(grad_weight.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "lengths,message", [([3, 1], "sum to N=5"), ([6, -1], ">= 0"), ([2, 2, 1], "weights must be")]
)
def test_bad_sequence_lengths_are_clear_errors(lengths, message):
    hidden, weight, targets, _ = make_inputs(5, 64, 100)
    with pytest.raises(ValueError, match=message):
        weighted_token_nll(hidden, weight, targets, torch.ones(2), sequence_lengths=lengths)


@pytest.mark.parametrize("op", ["weighted_token_nll", "fused_policy_loss"])
def test_a_frozen_head_gets_no_weight_gradient_and_the_same_hidden_gradient(op):
    """LoRA freezes the LM head: the fused ops then form no dW (neither its fp32 [V, H] nor its
    GEMMs), and the hidden states' gradient is the one a trained head gives, bit for bit."""
    from rlvr_fast.ops.policy_loss import fused_policy_loss

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=generator)
    weight = torch.randn(37, 16, generator=generator)
    targets = torch.randint(0, 37, (9,), generator=generator)

    def hidden_gradient(trained_head: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trained_head)
        if op == "weighted_token_nll":
            loss = weighted_token_nll(h, w, targets, torch.linspace(-1, 1, 9), chunk_size=4)
        else:
            advantages = torch.tensor([0.5, -1.0])
            loss = fused_policy_loss(h, w, targets, None, advantages, [4, 5], chunk_size=4)[0]
        loss.backward()
        return h.grad, w.grad

    frozen, trained = hidden_gradient(False), hidden_gradient(True)
    assert frozen[1] is None and trained[1] is not None
    assert torch.equal(frozen[0], trained[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp16_gradients_scale_by_a_loss_scale_beyond_fp16s_range(backend):
    """fp16-mixed runs backward from the loss times 2^16 (``rlvr_fast.train.loss_scale``),
    which no fp16 number holds (the largest is 65,504): the hidden gradient is the unscaled one
    times 2^16 bit for bit, not infinities, and dW (accumulated in fp32, then rounded) the
    unscaled one within its rounding, finer where the unscaled one is subnormal."""
    hidden, weight, targets, weights = make_inputs(13, 16, 40)
    inputs = hidden, weight, targets, weights * 2**-10  # a GRPO step's size: scaled, it fits

    def scaled(scale):
        def loss(h, w, targets, weights):
            return weighted_token_nll(h, w, targets, weights, chunk_size=5, backend=backend) * scale

        return loss_and_grads(loss, *inputs, torch.float16)

    (_, dh, dw), (_, dh_scaled, dw_scaled) = scaled(1.0), scaled(2.0**16)
    assert dh.abs().max() > 0 and torch.equal(dh_scaled, dh * 2**16)
    torch.testing.assert_close(dw_scaled / 2**16, dw, rtol=2**-10, atol=2**-24)
