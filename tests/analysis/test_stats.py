"""rlvr_fast.analysis.stats: mean ± SD and paired differences by hand, the bootstrap against scipy, and the
two-level resampler resampling at both levels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from rlvr_fast.analysis.stats import (
    bootstrap_mean_ci,
    mean_sd,
    paired_differences,
    two_level_bootstrap_ci,
)


def test_mean_sd_by_hand():
    # The study's baseline on MATH-500: 44.4 / 45.0 / 48.8 -> 46.07 ± 2.39.
    mean, sd = mean_sd([44.4, 45.0, 48.8])
    assert mean == pytest.approx(138.2 / 3)
    assert sd == pytest.approx(
        math.sqrt(((44.4 - mean) ** 2 + (45.0 - mean) ** 2 + (48.8 - mean) ** 2) / 2)
    )
    assert (round(mean, 2), round(sd, 2)) == (46.07, 2.39)
    assert mean_sd([1, 2, 3, 4]) == pytest.approx((2.5, math.sqrt(5 / 3)))
    assert mean_sd([0.7]) == (0.7, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        mean_sd([])


def test_paired_differences_by_hand():
    arm = {42: 0.444, 101: 0.450, 7: 0.488}
    reference = {7: 0.456, 42: 0.450, 101: 0.446, 9: 0.9}
    diffs = paired_differences(arm, reference)
    assert list(diffs) == [42, 101, 7]
    assert [round(d, 3) for d in diffs.values()] == [-0.006, 0.004, 0.032]
    with pytest.raises(ValueError, match="no seed in common"):
        paired_differences({1: 0.5}, {2: 0.5})


def test_bootstrap_is_reproducible_with_a_seed():
    values = np.random.default_rng(1).normal(size=300)
    assert bootstrap_mean_ci(values, seed=5) == bootstrap_mean_ci(values, seed=5)
    assert bootstrap_mean_ci(values, seed=5) != bootstrap_mean_ci(values, seed=6)
    matrix = np.random.default_rng(2).normal(size=(3, 200))
    assert two_level_bootstrap_ci(matrix, seed=5) == two_level_bootstrap_ci(matrix, seed=5)
    assert two_level_bootstrap_ci(matrix, seed=5) != two_level_bootstrap_ci(matrix, seed=6)


@pytest.mark.parametrize("data_seed", [0, 1, 2])
def test_one_level_bootstrap_agrees_with_scipy_percentile(data_seed):
    """Paired item differences in {-1, 0, 1}; both 4,000-resample percentile intervals estimate
    the same quantiles, so they agree within Monte-Carlo error: the 2.5% quantile of B resamples
    has SD ~ 0.04 standard errors of the mean, a difference of two ~ 0.06; we allow 0.25."""
    values = np.random.default_rng(data_seed).choice([-1, 0, 0, 0, 1, 1], size=400)
    ours = bootstrap_mean_ci(values, seed=data_seed)
    theirs = scipy.stats.bootstrap(
        (values,),
        np.mean,
        n_resamples=4000,
        method="percentile",
        confidence_level=0.95,
        rng=np.random.default_rng(100 + data_seed),
    ).confidence_interval
    standard_error = values.std(ddof=1) / math.sqrt(values.size)
    assert abs(ours[0] - theirs.low) < 0.25 * standard_error
    assert abs(ours[1] - theirs.high) < 0.25 * standard_error
    assert ours[0] < values.mean() < ours[1]


def test_two_level_bootstrap_resamples_seeds_and_questions():
    """By construction: five seeds with identical per-question values give a CI of non-zero
    width (questions are resampled); giving each seed a constant offset widens it (seeds are
    resampled); shifting every question of every seed alike only moves it."""
    questions = np.random.default_rng(3).choice([-1.0, 0.0, 1.0], size=100)
    identical_seeds = np.tile(questions, (5, 1))
    offsets = np.array([-0.2, -0.1, 0.0, 0.1, 0.2])[:, None]

    def width(interval):
        return interval[1] - interval[0]

    base = two_level_bootstrap_ci(identical_seeds)
    assert width(base) > 0.1
    assert width(two_level_bootstrap_ci(identical_seeds + offsets)) > 1.5 * width(base)
    shifted = two_level_bootstrap_ci(identical_seeds + 0.3)
    assert width(shifted) == pytest.approx(width(base))
    assert shifted[0] == pytest.approx(base[0] + 0.3)


def test_two_level_with_one_seed_is_the_item_bootstrap_and_bad_input_is_refused():
    values = np.random.default_rng(4).choice([0.0, 1.0], size=50)
    low, high = two_level_bootstrap_ci(values[None, :])
    assert low < values.mean() < high
    with pytest.raises(ValueError, match=r"\[seeds, questions\]"):
        two_level_bootstrap_ci([1.0, 2.0])
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_mean_ci([1.0], resamples=0)
