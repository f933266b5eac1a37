"""TreeRL tree credit: hand-computed weights, the seed's Propositions 1-3, token layout, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlvr_fast.credit.group import ADVANTAGE_EPS, group_stats
from rlvr_fast.credit.tree import tree_credit
from rlvr_fast.credit.group import standardised_advantages

# Rewards 1,0 | 1,1 | 0,0 | 1,0: R̄ = 4/8 = 0.5, sigma_R = sqrt(8 * 0.25 / 7) = sqrt(2/7).
EXAMPLE = [[1, 0], [1, 1], [0, 0], [1, 0]]
SCALE = math.sqrt(2 / 7) + ADVANTAGE_EPS


def test_hand_computed_credit_at_beta_quarter():
    credit = tree_credit(EXAMPLE, [120, 98, 4, 0], beta=0.25)
    assert credit.r_mean == 0.5 and credit.sigma == pytest.approx(math.sqrt(2 / 7), rel=1e-6)
    # Ṽ = 0.75 V̂ + 0.25 M: pair 0 (V̂ 0.5, M 1) -> 0.625; pair 1 -> 1; pair 2 -> 0.
    # Pair 3 has tau = 0: leaf credit (R - 0.5) / scale on every token.
    expected_prefix = [[0.125, 0.125], [0.5, 0.5], [-0.5, -0.5], [0.5, -0.5]]
    # A_cont = (0.5 (R - 0.5) + 0.5 (R - V̂)) / scale.
    expected_cont = [[0.5, -0.5], [0.25, 0.25], [-0.25, -0.25], [0.5, -0.5]]
    torch.testing.assert_close(credit.prefix, torch.tensor(expected_prefix) / SCALE)
    torch.testing.assert_close(credit.continuation, torch.tensor(expected_cont) / SCALE)


def test_hand_computed_credit_alpha_one_and_zero():
    # alpha = 1: continuation credit is R - V̂ alone; alpha = 0: the leaf advantage.
    r = [[1, 0], [0, 0]]  # R̄ = 0.25, sigma_R = sqrt(3 * 0.0625 + 0.5625) / sqrt(3) = 0.5
    scale = 0.5 + ADVANTAGE_EPS
    sibling = tree_credit(r, [3, 3], alpha=1.0)
    torch.testing.assert_close(
        sibling.continuation, torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / scale
    )
    torch.testing.assert_close(sibling.prefix, torch.tensor([[0.25, 0.25], [-0.25, -0.25]]) / scale)
    leafwise = tree_credit(r, [3, 3], alpha=0.0)
    torch.testing.assert_close(
        leafwise.continuation, torch.tensor([[0.75, -0.25], [-0.25, -0.25]]) / scale
    )


def test_all_tau_zero_equals_the_flat_trainers_advantages_bitwise():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    credit = tree_credit([rewards[i : i + 2] for i in range(0, 8, 2)], [0, 0, 0, 0])
    flat, sigma = standardised_advantages(rewards)
    assert torch.equal(credit.prefix.flatten(), flat)
    assert torch.equal(credit.continuation.flatten(), flat)
    assert credit.sigma == sigma
    mean, std = group_stats(torch.tensor(rewards))
    assert float(mean) == 0.625 and float(std) == sigma


def test_homogeneous_tree_has_zero_credit():
    credit = tree_credit([[1, 1], [1, 1]], [5, 0], beta=0.25, clamped_prefix=True)
    assert credit.sigma == 0
    assert torch.equal(credit.prefix, torch.zeros(2, 2))
    assert torch.equal(credit.continuation, torch.zeros(2, 2))


reward_trees = st.integers(1, 6).flatmap(
    lambda k: (
        st.integers(1, 4)
        .filter(lambda b: k * b >= 2)
        .flatmap(
            lambda b: st.lists(
                st.lists(st.sampled_from([0.0, 1.0]), min_size=b, max_size=b),
                min_size=k,
                max_size=k,
            )
        )
    )
)


@settings(max_examples=200, deadline=None)
@given(rewards=reward_trees, data=st.data())
def test_proposition_1_beta_zero_prefix_sum_is_leaf_grpo(rewards, data):
    pairs, branches = len(rewards), len(rewards[0])
    taus = data.draw(st.lists(st.integers(0, 160), min_size=pairs, max_size=pairs))
    credit = tree_credit(rewards, taus)
    r = torch.tensor(rewards)
    leaf = (r - r.mean()) / (r.flatten().std() + ADVANTAGE_EPS)
    for k, tau in enumerate(taus):
        if tau > 0:
            torch.testing.assert_close(credit.prefix[k].sum(), leaf[k].sum(), atol=1e-5, rtol=1e-5)
            assert torch.equal(credit.prefix[k], credit.prefix[k, :1].expand(branches))


@settings(max_examples=200, deadline=None)
@given(rewards=reward_trees, data=st.data())
def test_proposition_2_beta_increment_is_nonnegative_on_every_subset(rewards, data):
    pairs, branches = len(rewards), len(rewards[0])
    beta = data.draw(st.floats(0.0, 1.0))
    subset = data.draw(st.lists(st.booleans(), min_size=pairs, max_size=pairs))
    taus = [100] * pairs
    plain, bonus = tree_credit(rewards, taus), tree_credit(rewards, taus, beta=beta)
    increment = sum(
        float((bonus.prefix[k] - plain.prefix[k]).sum()) for k in range(pairs) if subset[k]
    )
    r = torch.tensor(rewards, dtype=torch.float64)
    gap = sum(float(r[k].max() - r[k].mean()) for k in range(pairs) if subset[k])
    expected = branches * beta * gap / (plain.sigma + ADVANTAGE_EPS)
    assert increment == pytest.approx(expected, abs=1e-4)
    assert increment >= -1e-5
    # With every tau_k > 0 the beta = 0 prefix coefficients sum to zero over all pairs.
    assert abs(float(plain.prefix.sum())) < 1e-5


def test_proposition_2_counterexample_with_root_restarted_pairs():
    # Pair 1 shares a prefix with rewards (0, 0); pairs 2-4 were root-restarted (tau = 0), (1, 1).
    credit = tree_credit([[0, 0], [1, 1], [1, 1], [1, 1]], [120, 0, 0, 0])
    assert credit.r_mean == 0.75
    scale = credit.sigma + ADVANTAGE_EPS
    shared_sum = float(credit.prefix[0].sum())  # S = {pair 1}
    assert shared_sum == pytest.approx(-1.5 / scale, rel=1e-6)
    assert credit.sigma == pytest.approx(
        math.sqrt(6 * 0.0625 + 2 * 0.5625) / math.sqrt(7), rel=1e-6
    )


@pytest.mark.parametrize(
    "other_pairs,r_mean",
    [
        ([[1, 1], [1, 1], [0, 0]], 0.625),
        ([[1, 1], [1, 1], [1, 0]], 0.75),
        ([[1, 1], [1, 1], [1, 1]], 0.875),
    ],
)
def test_proposition_3_clamping_reinforces_below_average_prefixes(other_pairs, r_mean):
    rewards = [[1, 0]] + other_pairs  # pair 0 is divergent: V̂ = 0.5, M = 1, Ṽ = 0.625 at beta 0.25
    taus = [100, 100, 100, 100]
    plain = tree_credit(rewards, taus, beta=0.25)
    clamped = tree_credit(rewards, taus, beta=0.25, clamped_prefix=True)
    assert plain.r_mean == r_mean
    scale = plain.sigma + ADVANTAGE_EPS
    assert float(plain.prefix[0].sum()) <= 0
    assert float(plain.prefix[0].sum()) == pytest.approx(2 * (0.625 - r_mean) / scale, abs=1e-6)
    # Winner keeps (1 - R̄)/scale; the loser's (0.625 - R̄)/scale <= 0 is clamped to 0.
    torch.testing.assert_close(clamped.prefix[0], torch.tensor([(1 - r_mean) / scale, 0.0]))
    assert float(clamped.prefix[0].sum()) > 0
    # Pairs whose rewards agree, and every continuation, are untouched by clamping.
    for k, pair in enumerate(rewards):
        if len(set(pair)) == 1:
            assert torch.equal(clamped.prefix[k], plain.prefix[k])
    assert torch.equal(clamped.continuation, plain.continuation)


def test_clamping_leaves_a_tau_zero_pair_with_leaf_credit():
    credit = tree_credit([[1, 0], [0, 0]], [0, 7], beta=0.25, clamped_prefix=True)
    torch.testing.assert_close(credit.prefix[0], credit.continuation[0])
    torch.testing.assert_close(
        credit.prefix[0], torch.tensor([0.75, -0.25]) / (0.5 + ADVANTAGE_EPS)
    )


def test_token_weights_layout_normal_terminal_dup_and_tau_zero():
    credit = tree_credit(EXAMPLE, [3, 2, 4, 0], beta=0.25)
    weights = credit.token_weights([[5, 3], [2, 4], [4, 4], [1, 3]])
    assert [len(w) for w in weights] == [5, 3, 2, 4, 4, 4, 1, 3]
    p, c = credit.prefix, credit.continuation
    # Normal pair: 3 prefix tokens then the branch's own continuation.
    assert torch.equal(weights[0], torch.stack([p[0, 0]] * 3 + [c[0, 0]] * 2))
    assert torch.equal(weights[1], torch.stack([p[0, 1]] * 3))
    # Leaf (1, 0) is its prefix alone; pair 2 is terminal_dup: zero-length continuations.
    assert torch.equal(weights[2], torch.stack([p[1, 0]] * 2))
    assert torch.equal(weights[4], torch.full((4,), float(p[2, 0])))
    assert torch.equal(weights[5], weights[4])
    # tau = 0: leaf credit (R - R̄)/scale on every token.
    assert torch.equal(weights[6], torch.full((1,), float(c[3, 0])))
    torch.testing.assert_close(weights[7], torch.full((3,), -0.5 / SCALE))
    assert all(w.dtype == torch.float32 for w in weights)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(rewards=[[1, 0], [1]], prefix_lens=[1, 1]), r"\[K\]\[B\] grid"),
        (dict(rewards=[[1]], prefix_lens=[1]), "K\\*B >= 2"),
        (dict(rewards=[], prefix_lens=[]), "non-empty"),
        (dict(rewards=[[1, float("nan")]], prefix_lens=[1]), "finite"),
        (dict(rewards=[[1, 0]], prefix_lens=[1, 2]), "one entry per pair"),
        (dict(rewards=[[1, 0]], prefix_lens=[-1]), "integers >= 0"),
        (dict(rewards=[[1, 0]], prefix_lens=[1.5]), "integers >= 0"),
        (dict(rewards=[[1, 0]], prefix_lens=[1], beta=1.5), "beta must be in"),
        (dict(rewards=[[1, 0]], prefix_lens=[1], alpha=-0.1), "alpha must be in"),
        (dict(rewards=[[1, 0]], prefix_lens=[1], eps=0.0), "eps must be > 0"),
    ],
)
def test_bad_inputs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tree_credit(**kwargs)


def test_token_weights_refuse_bad_lengths():
    credit = tree_credit(EXAMPLE, [3, 2, 4, 0])
    with pytest.raises(ValueError, match=r"\[K=4\]\[B=2\]"):
        credit.token_weights([[5, 3], [2, 4], [4, 4]])
    with pytest.raises(
        ValueError, match=r"leaf \(2, 1\) has length 3, shorter than its prefix of 4"
    ):
        credit.token_weights([[5, 3], [2, 4], [4, 3], [1, 3]])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_centred_continuations_carry_zero_signed_token_mass(data):
    """Random trees: after ``zero_continuation_mass`` the continuation tokens' weights sum to
    zero, every continuation weight moved by the same shift, and prefix weights did not move."""
    pairs = data.draw(st.integers(1, 5))
    rewards = data.draw(
        st.lists(
            st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=2),
            min_size=pairs,
            max_size=pairs,
        )
    )
    taus = data.draw(st.lists(st.integers(0, 20), min_size=pairs, max_size=pairs))
    lengths = [[tau + data.draw(st.integers(0, 60)) for _ in range(2)] for tau in taus]
    credit = tree_credit(rewards, taus, beta=data.draw(st.sampled_from([0.0, 0.25])))
    centred = credit.zero_continuation_mass(lengths)
    counts = torch.tensor(
        [[n - tau for n in row] for row, tau in zip(lengths, taus)], dtype=torch.float64
    )
    mass = float((counts * centred.continuation.double()).sum())
    assert abs(mass) <= 1e-4 * max(1.0, float(counts.sum()))
    assert torch.equal(centred.prefix, credit.prefix)
    shift = centred.continuation - credit.continuation
    if counts.sum() > 0:
        torch.testing.assert_close(shift, shift.flatten()[0].expand_as(shift))
    # Token by token: the weights of the continuation tokens (t > tau_k) sum to zero.
    weights = centred.token_weights(lengths)
    continuation_sum = sum(
        float(w[tau:].double().sum())
        for w, tau in zip(weights, [tau for tau in taus for _ in range(2)])
    )
    assert abs(continuation_sum) <= 1e-4 * max(1.0, float(counts.sum()))


def test_centring_by_hand_and_without_continuation_tokens():
    # EXAMPLE, prefixes 2, 2, 1, 0 and leaves of 5, 3 | 2, 6 | 1, 1 | 4, 2 tokens: continuation
    # counts 3, 1 | 0, 4 | 0, 0 | 4, 2 with weights (x SCALE) 0.5, -0.5 | 0.25, 0.25 |
    # -0.25, -0.25 | 0.5, -0.5: mass (1.5 - 0.5 + 1 + 2 - 1) / SCALE = 3 / SCALE over 14 tokens.
    credit = tree_credit(EXAMPLE, [2, 2, 1, 0])
    centred = credit.zero_continuation_mass([[5, 3], [2, 6], [1, 1], [4, 2]])
    torch.testing.assert_close(centred.continuation, credit.continuation - 3 / 14 / SCALE)
    # Every pair terminal (leaf = prefix): no continuation tokens, nothing to centre.
    terminal = tree_credit(EXAMPLE, [3, 3, 3, 3])
    assert terminal.zero_continuation_mass([[3, 3]] * 4) is terminal
    with pytest.raises(ValueError, match="shorter than its prefix"):
        credit.zero_continuation_mass([[1, 3], [2, 6], [1, 1], [4, 2]])
