"""Shapley values: the axioms on random games (exact, and Monte-Carlo within 4 standard errors),
hand-computed 3-player games, the 1/sqrt(M) error of Monte-Carlo, the memo, the vote tie rule,
and the built-in utilities' scalar and batched forms against each other."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from rlvr_fast.credit.shapley import (
    Game,
    MajorityVote,
    MeanReward,
    PassAtK,
    TableUtility,
    from_indices,
    independent,
    leave_one_out,
    shapley_exact,
    shapley_monte_carlo,
    shapley_naive,
)


def by_definition(utility, n: int) -> np.ndarray:
    """The mean marginal contribution over all n! orderings: the oracle."""
    phi = np.zeros(n)
    orders = list(itertools.permutations(range(n)))
    for order in orders:
        mask = 0
        for j in order:
            phi[j] += utility(mask | 1 << j) - utility(mask)
            mask |= 1 << j
    return phi / len(orders)


def random_table(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=1 << n)


def with_null_player(table: np.ndarray, player: int) -> np.ndarray:
    """U(S) = U(S without player): the player never changes the utility."""
    masks = np.arange(len(table))
    return table[masks & ~(1 << player)]


def with_symmetric_players(table: np.ndarray, i: int, j: int) -> np.ndarray:
    """U averaged with its copy where players i and j trade places."""
    masks = np.arange(len(table))
    bit_i, bit_j = (masks >> i) & 1, (masks >> j) & 1
    swapped = masks & ~(1 << i) & ~(1 << j) | bit_i << j | bit_j << i
    return (table + table[swapped]) / 2


def monte_carlo(
    table: np.ndarray, n: int, seed: int, permutations: int = 400, antithetic: bool = True
):
    return shapley_monte_carlo(
        TableUtility(table),
        n,
        permutations=permutations,
        generator=torch.Generator().manual_seed(seed),
        antithetic=antithetic,
    )


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_exact_matches_the_definition_and_the_naive_loop(n):
    utility = TableUtility(random_table(n, seed=n))
    expected = by_definition(utility.value, n)
    np.testing.assert_allclose(shapley_exact(utility, n).phi, expected, atol=1e-12)
    np.testing.assert_allclose(shapley_naive(utility.value, n), expected, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_axioms_exact(seed):
    n = 6
    table = with_symmetric_players(with_null_player(random_table(n, seed), 4), 1, 3)
    result = shapley_exact(TableUtility(table), n)
    assert result.phi.sum() == pytest.approx(table[-1] - table[0], abs=1e-12)  # efficiency
    assert result.phi[1] == pytest.approx(result.phi[3], abs=1e-12)  # symmetry
    assert result.phi[4] == pytest.approx(0.0, abs=1e-12)  # null player
    other = random_table(n, seed + 100)
    combined = shapley_exact(TableUtility(table + other), n).phi
    np.testing.assert_allclose(
        combined, result.phi + shapley_exact(TableUtility(other), n).phi, atol=1e-12
    )  # additivity
    assert (result.se == 0).all() and result.utility_calls == 1 << n
    assert (result.full, result.empty) == (table[-1], table[0])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("antithetic", [True, False])
def test_axioms_monte_carlo_within_four_standard_errors(seed, antithetic):
    n = 6
    table = with_symmetric_players(with_null_player(random_table(n, seed), 4), 1, 3)
    result = monte_carlo(table, n, seed, antithetic=antithetic)
    exact = shapley_exact(TableUtility(table), n).phi
    assert (result.se[[0, 1, 2, 3, 5]] > 0).all()
    assert (np.abs(result.phi - exact) <= 4 * result.se + 1e-12).all()
    # Every ordering's marginals add up to U(N) - U(∅), so efficiency holds exactly.
    assert result.phi.sum() == pytest.approx(table[-1] - table[0], abs=1e-12)
    assert result.phi[4] == 0.0 and result.se[4] == 0.0  # null player
    spread = 4 * math.hypot(result.se[1], result.se[3])
    assert abs(result.phi[1] - result.phi[3]) <= spread  # symmetry
    # Additivity: the same orderings (same seed) make the estimate linear in U.
    other = random_table(n, seed + 100)
    combined = monte_carlo(table + other, n, seed, antithetic=antithetic).phi
    np.testing.assert_allclose(
        combined, result.phi + monte_carlo(other, n, seed, antithetic=antithetic).phi, atol=1e-12
    )
    assert result.permutations == 400


def test_monte_carlo_error_shrinks_like_one_over_sqrt_m():
    n, repeats = 5, 300
    table = random_table(n, seed=7)
    exact = shapley_exact(TableUtility(table), n).phi
    generator = torch.Generator().manual_seed(0)
    errors, mean_se = {}, {}
    for m in (16, 256):
        draws = [
            shapley_monte_carlo(
                TableUtility(table), n, permutations=m, generator=generator, antithetic=False
            )
            for _ in range(repeats)
        ]
        errors[m] = np.sqrt(np.mean([(d.phi - exact) ** 2 for d in draws]))
        mean_se[m] = np.sqrt(np.mean([d.se**2 for d in draws]))
    assert 3.4 < errors[16] / errors[256] < 4.7  # sqrt(256 / 16) = 4
    for m in errors:  # the reported standard error estimates the actual error
        assert mean_se[m] == pytest.approx(errors[m], rel=0.15)


def test_antithetic_pairs_reduce_the_error_on_a_nearly_additive_game():
    n, repeats = 6, 200
    weights = np.random.default_rng(3).normal(size=n)
    masks = np.arange(1 << n)
    table = ((masks[:, None] >> np.arange(n)) & 1) @ weights + 0.1 * random_table(n, seed=3)
    exact = shapley_exact(TableUtility(table), n).phi
    generator = torch.Generator().manual_seed(1)
    error = {}
    for antithetic in (False, True):
        draws = [
            shapley_monte_carlo(
                TableUtility(table), n, permutations=16, generator=generator, antithetic=antithetic
            ).phi
            for _ in range(repeats)
        ]
        error[antithetic] = np.sqrt(np.mean((np.array(draws) - exact) ** 2))
    assert error[True] < error[False]


# Hand-computed 3-player games -------------------------------------------------------------


def test_glove_game():
    """Player 0 holds a left glove, 1 and 2 right ones; a pair is worth 1."""

    def pairs(players: tuple[int, ...]) -> float:
        return float(0 in players and (1 in players or 2 in players))

    result = shapley_exact(from_indices(pairs), 3)
    np.testing.assert_allclose(result.phi, [2 / 3, 1 / 6, 1 / 6], atol=1e-15)


def test_vote_game_by_hand():
    """Paths 0 and 1 correct, path 2 wrong. U: {0}, {1}: 1; {2}: 0; {0,1}: 1; {0,2}, {1,2}: a
    two-way tie, 1/2; N: 1. phi_0 = 1/3 * 1 + 1/6 * 0 + 1/6 * 1/2 + 1/3 * 1/2 = 7/12;
    phi_2 = 1/6 * (-1/2) * 2 = -1/6."""
    vote = MajorityVote(["4", "4", "5"], [True, True, False])
    np.testing.assert_allclose(shapley_exact(vote, 3).phi, [7 / 12, 7 / 12, -1 / 6], atol=1e-15)
    np.testing.assert_allclose(leave_one_out(vote, 3).phi, [1 / 2, 1 / 2, 0])
    np.testing.assert_allclose(independent(vote, 3).phi, [1, 1, 0])


def test_pass_at_k_and_mean_reward_by_hand():
    np.testing.assert_allclose(shapley_exact(PassAtK([True, False, False]), 3).phi, [1, 0, 0])
    # Mean reward of [1, 0, 0]: {0,1}, {0,2}: 1/2; N: 1/3.
    # phi_0 = 1/3 + 1/6 * 1/2 * 2 + 1/3 * 1/3 = 11/18; phi_1 = phi_2 = (1/3 - 11/18) / 2.
    np.testing.assert_allclose(
        shapley_exact(MeanReward([1, 0, 0]), 3).phi, [11 / 18, -5 / 36, -5 / 36], atol=1e-15
    )


# The vote's tie rule ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "answers,correct,expected",
    [
        (["4", "5"], [True, False], 1 / 2),  # two-way tie including the right answer
        (["4", "5", "7"], [True, False, False], 1 / 3),  # three-way tie
        (["5", "5", "4"], [False, False, True], 0.0),  # a wrong majority
        (
            ["5", " 5 ", "4", "4.0"],
            [False, False, True, True],
            1 / 2,
        ),  # classes: normalised / graded
        (["4", None, None], [True, False, False], 1.0),  # no answer abstains
        ([None, None], [False, False], 0.0),  # everyone abstains
        (["5", "6", "4", "4"], [False, False, True, True], 1.0),
    ],
)
def test_vote_tie_rule(answers, correct, expected):
    vote = MajorityVote(answers, correct)
    everyone = (1 << len(answers)) - 1
    assert vote.value(everyone) == pytest.approx(expected)
    assert vote.value(0) == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: MajorityVote(
            ["1", "2", "1", "3", None, "2", "2", "1", "9"],
            [True, False, True, False, False, False, False, True, False],
        ),
        lambda: PassAtK([False, True, False, False, True, False, False, False, False]),
        lambda: MeanReward([0.5, 1, 0, 0, 1, 0, 0.25, 1, 0]),
    ],
)
def test_batched_values_equal_one_at_a_time(make):
    utility = make()
    masks = np.arange(1 << 9)
    np.testing.assert_array_equal(utility.values(masks), [utility.value(int(m)) for m in masks])


def test_vote_refuses_a_correct_path_without_an_answer():
    with pytest.raises(ValueError, match="without an answer cannot be correct"):
        MajorityVote([None], [True])
    with pytest.raises(ValueError, match="one correctness per answer"):
        MajorityVote(["1"], [True, False])


# The memo and the errors ------------------------------------------------------------------


def test_each_coalition_is_scored_once():
    calls = []

    def utility(mask: int) -> float:
        calls.append(mask)
        return float(mask.bit_count() ** 2)

    game = Game(utility, 5)
    assert shapley_exact(game, 5).utility_calls == 32
    leave_one_out(game, 5)
    independent(game, 5)
    shapley_monte_carlo(game, 5, permutations=8, generator=torch.Generator().manual_seed(0))
    assert sorted(calls) == list(range(32))


def test_monte_carlo_memo_beyond_sixteen_players():
    calls = []

    def utility(mask: int) -> float:
        calls.append(mask)
        return float(mask.bit_count())

    result = shapley_monte_carlo(
        utility, 40, permutations=6, generator=torch.Generator().manual_seed(0)
    )
    np.testing.assert_allclose(result.phi, np.ones(40))  # additive game: exact for any ordering
    assert len(calls) == len(set(calls)) == result.utility_calls
    assert result.utility_calls <= 6 * 40 + 1


def test_batched_utility_is_called_once_per_batch():
    batches = []

    class Counting:
        def values(self, masks):
            batches.append(len(masks))
            return np.zeros(len(masks))

    shapley_exact(Counting(), 4)
    assert batches == [16]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: shapley_exact(TableUtility(np.zeros(2)), 17), "n <= 16"),
        (lambda: shapley_monte_carlo(TableUtility(np.zeros(8)), 3, permutations=5), "even number"),
        (
            lambda: shapley_monte_carlo(
                TableUtility(np.zeros(8)), 3, permutations=1, antithetic=False
            ),
            "permutations >= 2",
        ),
        (
            lambda: shapley_exact(type("Bad", (), {"values": lambda self, m: [0.0]})(), 2),
            "one value per coalition",
        ),
        (lambda: Game(3.0, 2), "callable"),
        (lambda: TableUtility(np.zeros(6)), "2\\^n entries"),
    ],
)
def test_errors_are_one_clear_line(call, message):
    with pytest.raises(ValueError, match=message):
        call()
