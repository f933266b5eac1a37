"""The study's statistics (seed §5.2-§5.3): mean ± SD over seeds, paired per-seed differences and
percentile bootstrap 95% confidence intervals, as pure functions of plain numbers.

Conventions, as in the study's tables:
- SD is the sample standard deviation over seeds (Bessel's correction, n - 1 in the denominator):
  44.4 / 45.0 / 48.8 gives 46.07 ± 2.39.
- A paired difference is taken per seed, arm minus reference, on the items both answered.
- Bootstrap intervals are percentile intervals: the (1 - level)/2 and (1 + level)/2 quantiles
  (numpy's linear interpolation) of the statistic over ``resamples`` resamples drawn from a
  ``numpy.random.Generator`` seeded with ``seed``, so the same call gives the same interval.
- The two-level bootstrap (seed x question) resamples seeds with replacement, then, inside every
  drawn seed, that seed's questions with replacement; the statistic is the mean over drawn seeds
  of the mean over drawn questions. The pooled-item bootstrap treats every (seed, question) pair
  as one unit and resamples those.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95
# Resamples drawn at once: bounds the index array at chunk x seeds x items integers.
_CHUNK_CELLS = 4_000_000


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Sample mean and sample standard deviation (n - 1 denominator); SD is 0.0 for one value."""
    if not values:
        raise ValueError("mean_sd needs at least one value")
    mean = math.fsum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance)


def paired_differences(
    arm: Mapping[int, float], reference: Mapping[int, float]
) -> dict[int, float]:
    """arm[s] - reference[s] for every seed s both have, in the arm's seed order."""
    common = [s for s in arm if s in reference]
    if not common:
        raise ValueError(
            f"no seed in common: arm has {sorted(arm)}, reference has {sorted(reference)}"
        )
    return {s: arm[s] - reference[s] for s in common}


def percentile_interval(statistics: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap statistics: quantiles (1 -/+ level)/2."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    low, high = np.percentile(statistics, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def bootstrap_mean_ci(
    values: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """One-level percentile bootstrap CI of the mean: resample the n values with replacement
    ``resamples`` times, take each resample's mean. Used for the pooled-item CI, where the values
    are the paired differences of every (seed, question) pair."""
    data = np.asarray(values, dtype=np.float64).ravel()
    if data.size == 0:
        raise ValueError("bootstrap_mean_ci needs at least one value")
    _check_resamples(resamples)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, _CHUNK_CELLS // data.size)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = data[rng.integers(0, data.size, (stop - start, data.size))].mean(axis=1)
    return percentile_interval(means, level)


def two_level_bootstrap_ci(
    matrix: Sequence[Sequence[float]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """Two-level (seed x question) percentile bootstrap CI of the grand mean of ``matrix``
    [seeds, questions] (one row per seed; a row holds per-question values, e.g. paired
    differences in correctness). Each resample draws S seeds with replacement, then N questions
    with replacement independently inside each drawn seed, and takes the mean over the S x N
    draws. With one seed this is the one-level bootstrap over its questions."""
    data = np.asarray(matrix, dtype=np.float64)
    if data.ndim != 2 or data.size == 0:
        raise ValueError(
            f"two_level_bootstrap_ci needs a non-empty [seeds, questions] matrix, "
            f"got shape {data.shape}"
        )
    _check_resamples(resamples)
    seeds, items = data.shape
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, _CHUNK_CELLS // (seeds * items))
    for start in range(0, resamples, chunk):
        count = min(resamples, start + chunk) - start
        drawn_seeds = rng.integers(0, seeds, (count, seeds))
        drawn_items = rng.integers(0, items, (count, seeds, items))
        means[start : start + count] = data[drawn_seeds[:, :, None], drawn_items].mean(axis=(1, 2))
    return percentile_interval(means, level)


def _check_resamples(resamples: int) -> None:
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
