"""Next-token sampling: the study's top-p rule, the exponential race, one stream per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_fast.engine.token_sampler import (
    SamplingParams,
    derive_seed,
    sample_tokens,
    top_p_probs,
    uniform_noise,
)


def seed_reference_filter(probs: list[float], top_p: float) -> dict[int, float]:
    """The study's rule written out in plain Python: sort descending, keep a token while the
    cumulative probability before it is < top_p, always keep the first, renormalise."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, before = [], 0.0
    for rank, token in enumerate(order):
        if rank == 0 or before < top_p:
            kept.append(token)
        before += probs[token]
    total = sum(probs[t] for t in kept)
    return {t: probs[t] / total for t in kept}


def kept_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> dict[int, float]:
    kept, ids = top_p_probs(logits, temperature, top_p)
    total = float(kept[0].sum())
    return {int(t): float(p) / total for t, p in zip(ids[0], kept[0]) if p > 0}


@pytest.mark.parametrize(
    "top_p,kept", [(0.9, {0, 1, 2}), (0.5, {0}), (0.51, {0, 1}), (1e-6, {0}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_tokens_while_mass_before_is_below_top_p(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    got = kept_distribution(torch.tensor([probs]).log(), 1.0, top_p)
    expected = seed_reference_filter(probs, top_p)
    assert set(got) == kept == set(expected)
    for token, p in expected.items():
        assert math.isclose(got[token], p, rel_tol=1e-6)


def test_temperature_is_applied_before_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sharpened = torch.softmax(logits / 0.5, dim=-1)[0].tolist()
    expected = seed_reference_filter(sharpened, 0.9)
    got = kept_distribution(logits, 0.5, 0.9)
    assert got.keys() == expected.keys()
    assert all(math.isclose(got[t], expected[t], rel_tol=1e-5) for t in got)


def test_draws_follow_the_filtered_distribution():
    """20,000 streams (one seed each) drawing from the same logits: every kept token within 5
    standard deviations of its renormalised probability, dropped tokens never drawn."""
    probs = [0.4, 0.25, 0.2, 0.1, 0.05]
    draws = 20000
    logits = torch.tensor([probs]).log().expand(draws, -1)
    tokens = sample_tokens(
        logits, torch.arange(draws), torch.zeros(draws, dtype=torch.long), 1.0, 0.8, greedy=False
    )
    counts = torch.bincount(tokens, minlength=5).tolist()
    expected = seed_reference_filter(probs, 0.8)
    assert counts[3] == counts[4] == 0
    for token, p in expected.items():
        assert abs(counts[token] - draws * p) < 5 * math.sqrt(draws * p * (1 - p))


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    tokens = sample_tokens(
        logits,
        torch.zeros(6, dtype=torch.long),
        torch.zeros(6, dtype=torch.long),
        0.0,
        1.0,
        greedy=True,
    )
    assert torch.equal(tokens, logits.argmax(-1))


def test_a_draw_depends_only_on_its_own_seed_position_and_logits():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 40, generator=generator)
    seeds = torch.randint(0, 2**62, (9,), generator=generator)
    positions = torch.randint(0, 3000, (9,), generator=generator)
    tokens = sample_tokens(logits, seeds, positions, 0.8, 0.9, greedy=False)
    order = torch.randperm(9, generator=generator)
    shuffled = sample_tokens(logits[order], seeds[order], positions[order], 0.8, 0.9, greedy=False)
    assert torch.equal(shuffled, tokens[order])
    alone = [
        int(
            sample_tokens(
                logits[i : i + 1], seeds[i : i + 1], positions[i : i + 1], 0.8, 0.9, greedy=False
            )
        )
        for i in range(9)
    ]
    assert alone == tokens.tolist()
    # Another position is another draw: over 200 positions, a 40-way draw cannot stay put.
    moved = sample_tokens(
        logits[:1].expand(200, -1), seeds[:1].expand(200), torch.arange(200), 1.0, 1.0, greedy=False
    )
    assert len(set(moved.tolist())) > 5


def splitmix_reference(seed: int, position: int, rank: int) -> float:
    """The noise hash in plain Python integers modulo 2^64."""
    mask = 2**64 - 1
    x = (
        seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + rank * 0x8CB92BA72F3D8DD7
    ) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return ((x >> 41) + 0.5) / 2**23


def test_uniform_noise_is_the_splitmix_hash_of_seed_position_and_rank():
    """torch's wrapping int64 arithmetic computes exactly the modular hash, negative seeds and
    large positions included, and every value lies strictly inside (0, 1)."""
    seeds = torch.tensor([0, 1, 2**62 + 12345, -7, 987654321])
    positions = torch.tensor([0, 5, 1, 2**40, 77])
    noise = uniform_noise(seeds, positions, 64)
    for row, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist())):
        expected = [splitmix_reference(seed % 2**64, position, rank) for rank in range(64)]
        assert noise[row].tolist() == pytest.approx(expected, rel=0, abs=0)
    big = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert 0 < float(big.min()) and float(big.max()) < 1
    assert abs(float(big.mean()) - 0.5) < 0.005


def test_derived_seeds_are_distinct_and_non_negative():
    seeds = [derive_seed(base, index) for base in (0, 1, 2**61) for index in range(2000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# Fewer rows at the largest vocabulary: the reference sorts every row.
@pytest.mark.parametrize("vocab,rows", [(2, 2000), (211, 2000), (384, 2000), (5000, 256)])
def test_cpp_draws_equal_the_reference(vocab, rows):
    """The C++ sampler computes the same rule and the same streams: the same token in every row
    but where float32 rounding of exp or log decides a near tie (none expected at this size)."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    seeds = torch.randint(0, 2**62, (rows,), generator=generator)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    for temperature, top_p in ((0.8, 0.9), (1.0, 1.0), (0.5, 0.3)):
        reference = sample_tokens(logits, seeds, positions, temperature, top_p, greedy=False)
        fast = sample_tokens(
            logits, seeds, positions, temperature, top_p, greedy=False, backend="cpp"
        )
        assert (fast != reference).sum() <= rows // 500


def vocabulary_wide_rows(generator: torch.Generator, per_kind: int) -> torch.Tensor:
    """Logits [5 * per_kind, 151,936] whose nuclei take every way through the C++ sampler's
    bucketed top-p (csrc/sampling.cpp, draw_from_nucleus): flat (a random-weight model's, most
    of the vocabulary: the race prunes buckets by their bounds), graded, tied (integer logits:
    thousands of equal probabilities ranked by id), one token holding more than top_p alone
    (the cut right after rank 0) and peaked, whose nucleus at top_p 0.999999 reaches
    probabilities below 2^-29 (the prefix-sorting walk's rows) or keeps every token."""
    shape = (per_kind, 151_936)
    spike = torch.randn(shape, generator=generator) * 0.5
    spike[:, 123] = 14.0
    return torch.cat(
        [
            torch.randn(shape, generator=generator) * 0.6,
            torch.randn(shape, generator=generator) * 2.5,
            (torch.randn(shape, generator=generator) * 2).round(),
            spike,
            torch.randn(shape, generator=generator) * 12,
        ]
    )


@pytest.mark.parametrize(
    "temperature,top_p", [(0.8, 0.9), (1.0, 0.99), (0.6, 0.5), (1.0, 0.999999)]
)
def test_cpp_draws_equal_the_reference_over_vocabulary_wide_nuclei(temperature, top_p):
    """At Qwen3's vocabulary, where the C++ sampler finds the nucleus by buckets of p instead of
    ordering it: the reference's token in every row (no near tie at this size)."""
    generator = torch.Generator().manual_seed(41)
    logits = vocabulary_wide_rows(generator, per_kind=8)
    seeds = torch.randint(0, 2**62, (len(logits),), generator=generator)
    positions = torch.randint(0, 4096, (len(logits),), generator=generator)
    reference = sample_tokens(logits, seeds, positions, temperature, top_p, greedy=False)
    fast = sample_tokens(logits, seeds, positions, temperature, top_p, greedy=False, backend="cpp")
    assert torch.equal(fast, reference)


@pytest.mark.parametrize(
    "top_p,kept", [(0.9, {0, 1, 2}), (0.5, {0}), (0.51, {0, 1}), (1.0, {0, 1, 2, 3})]
)
def test_cpp_draws_only_the_kept_tokens_in_proportion(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = 20000
    logits = torch.tensor([probs]).log().expand(draws, -1).contiguous()
    tokens = sample_tokens(
        logits,
        torch.arange(draws),
        torch.zeros(draws, dtype=torch.long),
        1.0,
        top_p,
        greedy=False,
        backend="cpp",
    )
    counts = torch.bincount(tokens, minlength=4).tolist()
    expected = seed_reference_filter(probs, top_p)
    assert {t for t, c in enumerate(counts) if c} == kept
    for token, p in expected.items():
        assert abs(counts[token] - draws * p) < 5 * math.sqrt(draws * p * (1 - p)) + 1e-9


def test_cpp_sampler_refuses_bad_input():
    from rlvr_fast._C import sample_top_p_cpu

    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        sample_top_p_cpu(
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(2, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
            1.0,
            0.9,
        )
    with pytest.raises(RuntimeError, match="int64 \\[B\\]"):
        sample_top_p_cpu(
            torch.zeros(2, 3),
            torch.zeros(3, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
            1.0,
            0.9,
        )
    with pytest.raises(RuntimeError, match="temperature > 0"):
        sample_top_p_cpu(
            torch.zeros(2, 3),
            torch.zeros(2, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
            0.0,
            0.9,
        )
