"""The sort-free Triton sampler (under TRITON_INTERPRET=1 on the CPU) against the study's rule:
the same tokens as the sorting reference (the same race on the same hashed noise), whichever
path a row takes (nucleus in the first window, top_p = 1 settled by the tail bound, flat rows
over many windows), a chi-square test of its draws against the rule's distribution, and draws
that depend only on a row's own seed, position and logits.

The kernel's candidate scratch is ``CAP`` = 4096 slots on the GPU; here tests pass small caps,
which the interpreter sorts quickly and which send rows down the windowed path too."""

from __future__ import annotations

import math

import pytest
import torch

from devices import CUDA, DEVICE, on_device
from rlvr_fast.kernels.top_p_sampling import (
    device_scalar,
    draw_triton,
    histogram_triton,
    row_stats_triton,
    sample_tokens_reference,
)
from rlvr_fast.ops.top_p_sampling import sample_top_p


def seed_reference_filter(probs: list[float], top_p: float) -> dict[int, float]:
    """The study's rule in plain Python: sort descending, keep a token while the cumulative
    probability before it is < top_p, always keep the first, renormalise."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, before = [], 0.0
    for rank, token in enumerate(order):
        if rank == 0 or before < top_p:
            kept.append(token)
        before += probs[token]
    total = sum(probs[t] for t in kept)
    return {t: probs[t] / total for t in kept}


def triton_draws(logits, seeds, positions, temperature, top_p, cap, top_k=0, min_p=0.0):
    t, p = device_scalar(temperature, logits.device), device_scalar(top_p, logits.device)
    k, m = device_scalar(top_k, logits.device), device_scalar(min_p, logits.device)
    stats = row_stats_triton(logits, t)
    counts = histogram_triton(logits, t, p, k, m, stats)
    return draw_triton(logits, t, p, k, m, stats, counts, seeds, positions, cap=cap)


def streams(rows, generator):
    seeds = torch.randint(0, 2**62, (rows,), generator=generator)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    return seeds.to(DEVICE), positions.to(DEVICE)


@on_device
@pytest.mark.parametrize(
    "vocab,rows,scale,temperature,top_p,cap",
    [
        (2, 6, 1.0, 1.0, 0.9, 16),  # two tokens
        (384, 6, 3.0, 0.8, 0.9, 64),  # the tiny model's vocabulary, peaked
        (1000, 3, 3.0, 1.0, 1.0, 64),  # top_p = 1: every token kept, the race by token id
        (1000, 3, 0.2, 1.0, 1.0, 16),  # the same on flat rows
        (1000, 3, 3.0, 0.5, 0.3, 64),
        (200, 2, 0.2, 1.0, 0.95, 16),  # flat: the nucleus (~185 tokens) spans 12 windows
    ],
)
def test_triton_draws_the_references_tokens(vocab, rows, scale, temperature, top_p, cap):
    generator = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=generator) * scale).to(DEVICE)
    seeds, positions = streams(rows, generator)
    reference = sample_tokens_reference(logits, seeds, positions, temperature, top_p)
    fast = triton_draws(logits, seeds, positions, temperature, top_p, cap)
    assert torch.equal(fast, reference)


@on_device
@pytest.mark.parametrize(
    "vocab,rows,scale,top_p,top_k,min_p,cap",
    [
        (384, 4, 3.0, 0.9, 5, 0.0, 64),  # top-k inside the head window
        (1000, 2, 3.0, 1.0, 0, 0.05, 64),  # min-p bounds the candidates, top_p = 1
        (300, 3, 2.0, 0.8, 20, 0.1, 32),  # all three
        (40, 1, 0.2, 0.9, 20, 0.0, 16),  # flat: the k first outgrow the head window
        (2, 3, 1.0, 0.9, 7, 0.3, 16),  # k past the vocabulary: no top-k
        (1000, 12, 4.0, 0.9, 50, 0.05, 64),  # min-p cuts the candidates short of k
        (2000, 2, 0.2, 1.0, 500, 0.0, 64),  # flat, k's bin past the cap: windows keyed by id
        (2000, 2, 0.2, 0.9, 0, 0.05, 64),  # flat, top-p with min-p: the same
    ],
)
def test_triton_draws_the_references_tokens_with_top_k_and_min_p(
    vocab, rows, scale, top_p, top_k, min_p, cap
):
    generator = torch.Generator().manual_seed(vocab + top_k)
    logits = (torch.randn(rows, vocab, generator=generator) * scale).to(DEVICE)
    seeds, positions = streams(rows, generator)
    reference = sample_tokens_reference(logits, seeds, positions, 0.8, top_p, top_k, min_p)
    fast = triton_draws(logits, seeds, positions, 0.8, top_p, cap, top_k, min_p)
    assert torch.equal(fast, reference)


@on_device
def test_triton_draws_pass_a_chi_square_test_with_top_k_and_min_p():
    """p = (0.55, 0.2, 0.1, 0.08, 0.07), top_k 4, top_p 0.95, min_p 0.15 keep the first three
    (2/3 of the mass in the first): 60 streams' counts against the renormalised rule
    (chi-square, 2 degrees of freedom, p > 0.001), the dropped two never drawn."""
    probs = [0.55, 0.2, 0.1, 0.08, 0.07]
    draws = 60
    logits = torch.tensor([probs]).log().expand(draws, -1).contiguous().to(DEVICE)
    seeds = torch.arange(draws, device=DEVICE)
    tokens = triton_draws(logits, seeds, torch.zeros_like(seeds), 1.0, 0.95, 16, 4, 0.15)
    counts = torch.bincount(tokens.cpu(), minlength=5).tolist()
    assert counts[3] == counts[4] == 0
    expected = {t: probs[t] / sum(probs[:3]) for t in range(3)}
    chi_square = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    assert chi_square < 13.8, (counts, chi_square)


@on_device
def test_bf16_logits():
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 300, generator=generator) * 4).to(DEVICE, torch.bfloat16)
    seeds, positions = streams(3, generator)
    reference = sample_tokens_reference(logits, seeds, positions, 0.8, 0.9)
    assert torch.equal(triton_draws(logits, seeds, positions, 0.8, 0.9, 16), reference)


# The default cap's 4096-slot sort takes minutes in the interpreter: GPU suite only.
@pytest.mark.cuda
def test_the_default_cap_and_bf16_logits():
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(1, 151_936, generator=generator) * 4).to(DEVICE, torch.bfloat16)
    seeds, positions = streams(1, generator)
    reference = sample_tokens_reference(logits, seeds, positions, 0.8, 0.9)
    assert torch.equal(sample_top_p(logits, seeds, positions, 0.8, 0.9), reference)


@on_device
def test_triton_draws_pass_a_chi_square_test_against_the_rule():
    """60 streams (seeds 0..59) draw from the same logits: the counts of the 3 kept tokens
    against their renormalised probabilities (chi-square, 2 degrees of freedom, p > 0.001) and
    dropped tokens never drawn. The kept probabilities (2/3, 2/9, 1/9) are far apart, so 60
    draws (expected counts >= 6.7) still refuse a uniform draw among the kept (about 40)."""
    probs = [0.6, 0.2, 0.1, 0.06, 0.04]
    draws = 60
    logits = torch.tensor([probs]).log().expand(draws, -1).contiguous().to(DEVICE)
    seeds = torch.arange(draws, device=DEVICE)
    tokens = triton_draws(logits, seeds, torch.zeros_like(seeds), 1.0, 0.85, 16)
    counts = torch.bincount(tokens.cpu(), minlength=5).tolist()
    expected = seed_reference_filter(probs, 0.85)
    assert set(expected) == {0, 1, 2} and counts[3] == counts[4] == 0
    chi_square = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    # 3 kept tokens: 2 degrees of freedom; P(chi2_2 > 13.8) = exp(-13.8 / 2) = 0.001.
    assert chi_square < 13.8, (counts, chi_square)


@on_device
def test_a_draw_depends_only_on_its_own_seed_position_and_logits():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=generator).to(DEVICE)
    seeds, positions = streams(6, generator)
    tokens = triton_draws(logits, seeds, positions, 0.8, 0.9, 16)
    order = torch.randperm(6, generator=generator).to(DEVICE)
    shuffled = triton_draws(logits[order], seeds[order], positions[order], 0.8, 0.9, 16)
    assert torch.equal(shuffled, tokens[order])
    alone = triton_draws(logits[2:3], seeds[2:3], positions[2:3], 0.8, 0.9, 16)
    assert int(alone) == int(tokens[2])
    options = (16, 8, 0.02)  # cap, top_k, min_p
    tokens = triton_draws(logits, seeds, positions, 0.8, 0.9, *options)
    shuffled = triton_draws(logits[order], seeds[order], positions[order], 0.8, 0.9, *options)
    assert torch.equal(shuffled, tokens[order])


def test_the_reference_passes_a_chi_square_test_at_20000_draws():
    probs = [0.4, 0.25, 0.2, 0.1, 0.05]
    draws = 20000
    logits = torch.tensor([probs]).log().expand(draws, -1)
    tokens = sample_tokens_reference(
        logits, torch.arange(draws), torch.zeros(draws, dtype=torch.long), 1.0, 0.8
    )
    counts = torch.bincount(tokens, minlength=5).tolist()
    expected = seed_reference_filter(probs, 0.8)
    chi_square = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    assert counts[3] == counts[4] == 0 and chi_square < 13.8
    assert math.isclose(sum(expected.values()), 1.0)


def test_vocabularies_past_the_key_width_are_refused():
    logits = torch.zeros(1, 2**20)
    with pytest.raises(ValueError, match="up to 2\\^20 tokens"):
        sample_top_p(
            logits, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1.0, 0.9
        )


def reads_per_row(logits, temperature, top_p, top_k=0, min_p=0.0, cap=64) -> float:
    """Elements of ``logits`` the three passes load, per element: the reads of each row, as the
    interpreter runs the kernels' logic (every masked-in load from the logits' memory counted)."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    start = logits.data_ptr()
    end = start + logits.numel() * logits.element_size()
    loaded = 0
    load = interpreter.InterpreterBuilder.create_masked_load

    def counted(builder, ptrs, mask, *args):
        nonlocal loaded
        loaded += int(np.count_nonzero(mask.data & (ptrs.data >= start) & (ptrs.data < end)))
        return load(builder, ptrs, mask, *args)

    interpreter.InterpreterBuilder.create_masked_load = counted
    try:
        seeds = torch.arange(logits.shape[0])
        triton_draws(logits, seeds, torch.zeros_like(seeds), temperature, top_p, cap, top_k, min_p)
    finally:
        interpreter.InterpreterBuilder.create_masked_load = load
    return loaded / logits.numel()


@pytest.mark.skipif(CUDA, reason="counts the interpreter's loads")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("scale", [0.2, 4.0], ids=["flat", "peaked"])
def test_reads_of_each_row(rows, scale):
    """TRL's defaults (top_p = 1, no top-k, no min-p) read each row twice, flat or peaked (the
    race keyed by token id needs no rank); the trainer's (top_p 0.9) three times on peaked rows,
    and TRL's defaults draw the reference's tokens. (The trainer's on flat rows still takes
    more: bounded below.)"""
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 2000, generator=generator) * scale
    assert reads_per_row(logits, 0.8, 1.0) == 2
    if scale > 1:
        assert reads_per_row(logits, 0.8, 0.9) == 3
    seeds, positions = streams(rows, generator)
    reference = sample_tokens_reference(logits, seeds, positions, 0.8, 1.0)
    assert torch.equal(triton_draws(logits, seeds, positions, 0.8, 1.0, 64), reference)


@pytest.mark.skipif(CUDA, reason="counts the interpreter's loads")
@pytest.mark.parametrize(
    "top_p, top_k, min_p, flat, peaked",
    [
        (0.9, 0, 0.0, 61, 3),  # the trainer's default: a flat nucleus spans many windows
        (1.0, 0, 0.0, 2, 2),  # TRL's defaults: no filter, no histogram
        (0.95, 50, 0.0, 3, 3),  # top-k whose nucleus is larger than the window
        (1.0, 50, 0.0, 3, 3),
        (1.0, 0, 0.05, 2, 2),  # min-p alone: a threshold known after pass 1
        (0.9, 20, 0.1, 3, 3),  # min-p cuts short of k: the k ranks' mass still in the window
    ],
)
def test_reads_of_each_row_per_filter_setting(top_p, top_k, min_p, flat, peaked):
    """The reads of each row (4 rows of V = 2,000, candidate cap 64, T = 0.8) at each filter
    setting, flat (logits x 0.2) and peaked (x 4): every setting but the trainer's top-p alone
    on flat rows (its rank-keyed race orders the whole nucleus) in at most 3; a change that
    reads more fails here, one that reads less lowers the bound. Draws are the reference's."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 2000, generator=generator)
    for scale, most in ((0.2, flat), (4.0, peaked)):
        assert reads_per_row(logits * scale, 0.8, top_p, top_k, min_p) <= most, (scale, most)
    seeds, positions = streams(4, generator)
    options = (0.8, top_p, top_k, min_p)
    reference = sample_tokens_reference(logits * 0.2, seeds, positions, *options)
    assert torch.equal(
        triton_draws(logits * 0.2, seeds, positions, 0.8, top_p, 64, top_k, min_p), reference
    )


@pytest.mark.skipif(CUDA, reason="counts the interpreter's loads")
@pytest.mark.parametrize("top_p, top_k, min_p, most", [(0.95, 20, 0.0, 3), (1.0, 0, 0.05, 2)])
def test_reads_of_each_row_at_256_rows(top_p, top_k, min_p, most):
    """A batch of 256 flat rows (V = 128, cap 64) reads each row as often as one row does:
    one program per row, no row waiting on another."""
    generator = torch.Generator().manual_seed(256)
    logits = torch.randn(256, 128, generator=generator) * 0.2
    assert reads_per_row(logits, 0.8, top_p, top_k, min_p) <= most
    assert reads_per_row(logits[:1], 0.8, top_p, top_k, min_p) <= most
