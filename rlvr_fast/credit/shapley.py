"""Shapley values of a cooperative game over n players (parallel reasoning paths), and the
outcome-derived utilities the parallel-path arms score coalitions with.

A coalition S is a bitmask: bit j set <=> player j is in S (``from_indices`` adapts a utility
written on sorted index tuples). A utility is either

- a plain callable ``utility(mask: int) -> float``, evaluated once per coalition, or
- a batched one: an object with ``values(masks: np.ndarray[int64]) -> array [len(masks)]``
  that scores many coalitions in one call (the built-ins below and ``GenerativeJudge`` games);
  it may also offer ``value(mask)`` for one coalition.

Every estimator goes through a ``Game``, which memoises each coalition's utility (one evaluation
per distinct coalition) and counts the evaluations (``utility_calls``).

    phi_j = sum_{S ⊆ N \\ {j}} |S|! (n - |S| - 1)! / n! * (U(S ∪ {j}) - U(S))

- ``shapley_exact``: all 2^n coalitions scored in one batch, then phi = C_n @ U with the cached
  [n, 2^n] coefficient matrix (C[j, T] = w(|T| - 1) if j in T, else -w(|T|)); n <= 16.
- ``shapley_monte_carlo``: M random orderings; player j's estimate is the mean of its marginal
  contribution U(P_j ∪ {j}) - U(P_j) over them (P_j: the players before j). ``antithetic``
  pairs each drawn ordering with its reverse (M even); the standard error is the sample standard
  deviation of the independent units (orderings, or antithetic pairs' means) over sqrt(units).
  Every ordering's marginals sum to U(N) - U(∅), so the estimate is efficient exactly.
- ``leave_one_out``: U(N) - U(N \\ {j}) (the paper's LOO ablation); ``independent``:
  U({j}) - U(∅) (each path graded alone).
- ``shapley_naive``: the formula above as a plain Python loop, one utility call per term, no
  memo: the reference the benchmark compares with.

Built-in utilities on a step's K paths (player j = path j), each with ``value`` and ``values``:

- ``MajorityVote(answers, correct)``: the correctness of the majority answer of S. Correct
  paths form one answer class; a wrong answer's class is its normalised spelling
  (``rlvr_fast.grading.normalisation.normalize``); paths without an answer abstain. Tie rule:
  when c classes share the top count, U(S) is 1/c if the correct class is among them, else 0
  (the expected correctness of a uniformly random tie-break; deterministic, and symmetric in
  the players). U(S) = 0 when every path of S abstains, and U(∅) = 0.
- ``PassAtK(correct)``: 1 if any path of S is correct (pass@|S|), 0 on ∅.
- ``MeanReward(rewards)``: the mean reward of S's paths, 0 on ∅.
- ``TableUtility(table)``: U given on all 2^n coalitions (a stored game, replayed).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from rlvr_fast.grading.normalisation import normalize

MAX_EXACT_PLAYERS = 16
MAX_PLAYERS = 62  # coalitions are int64 bitmasks
MAX_PERMUTATIONS = 1 << 20  # Monte-Carlo orderings a run may ask for


@dataclass
class Attribution:
    """Per-player credit ``phi`` [n] (float64) with its standard error ``se`` [n] (zeros for
    exact methods), ``utility_calls`` (distinct coalitions scored), U(N) ``full`` and U(∅)
    ``empty``; ``permutations`` is M for Monte-Carlo, 0 otherwise."""

    phi: np.ndarray
    se: np.ndarray
    utility_calls: int
    full: float
    empty: float
    permutations: int = 0


class Game:
    """A utility on n players with a memo: each distinct coalition is scored once. The memo is a
    table over all 2^n coalitions for n <= 16 (lookups stay vectorised), a dict beyond."""

    def __init__(self, utility, n: int) -> None:
        if not 1 <= n <= MAX_PLAYERS:
            raise ValueError(f"need 1 <= n <= {MAX_PLAYERS} players, got {n}")
        if not (callable(utility) or hasattr(utility, "values")):
            raise ValueError(f"a utility must be callable or have values(masks), got {utility!r}")
        self.utility, self.n = utility, n
        dense = n <= MAX_EXACT_PLAYERS
        self.table = np.zeros(1 << n) if dense else None
        self.scored = np.zeros(1 << n, dtype=bool) if dense else None
        self.memo: dict[int, float] = {}

    @property
    def utility_calls(self) -> int:
        return int(self.scored.sum()) if self.table is not None else len(self.memo)

    def values(self, masks: np.ndarray) -> np.ndarray:
        """U of every coalition in ``masks`` (int64, any shape), scoring the new ones in one
        batch."""
        masks = np.asarray(masks, dtype=np.int64)
        if self.table is not None:
            fresh = np.zeros_like(self.scored)
            fresh[masks[~self.scored[masks]]] = True  # dedup without sorting
            new = np.flatnonzero(fresh)
            if len(new):
                self.table[new] = self._score(new)
                self.scored[new] = True
            return self.table[masks]
        new = [int(m) for m in np.unique(masks) if int(m) not in self.memo]
        if new:
            self.memo.update(zip(new, self._score(np.array(new, dtype=np.int64)).tolist()))
        return np.array([self.memo[int(m)] for m in masks.ravel()]).reshape(masks.shape)

    def all_values(self) -> np.ndarray:
        """U on all 2^n coalitions in mask order (n <= 16), the unscored ones in one batch."""
        if self.table is None:
            raise ValueError(f"all 2^n coalitions only for n <= {MAX_EXACT_PLAYERS}, got {self.n}")
        missing = np.flatnonzero(~self.scored)
        if len(missing):
            self.table[missing] = self._score(missing)
            self.scored[missing] = True
        return self.table

    def _score(self, masks: np.ndarray) -> np.ndarray:
        if hasattr(self.utility, "values"):
            scored = np.asarray(self.utility.values(masks), dtype=np.float64)
            if scored.shape != masks.shape:
                raise ValueError(
                    f"a batched utility must return one value per coalition "
                    f"({len(masks)}), got shape {scored.shape}"
                )
            return scored
        return np.array([float(self.utility(int(mask))) for mask in masks])


def from_indices(utility: Callable[[tuple[int, ...]], float]) -> Callable[[int], float]:
    """A bitmask utility from one written on sorted index tuples of the coalition's players."""

    def on_mask(mask: int) -> float:
        return utility(tuple(j for j in range(mask.bit_length()) if mask >> j & 1))

    return on_mask


def shapley_exact(utility, n: int) -> Attribution:
    """Exact Shapley values over all 2^n coalitions (n <= 16), vectorised."""
    if not 1 <= n <= MAX_EXACT_PLAYERS:
        raise ValueError(
            f"shapley_exact: need 1 <= n <= {MAX_EXACT_PLAYERS}, got {n} (use shapley_monte_carlo)"
        )
    game = utility if isinstance(utility, Game) else Game(utility, n)
    table = game.all_values()
    phi = _coefficients(n) @ table
    return Attribution(phi, np.zeros(n), game.utility_calls, float(table[-1]), float(table[0]))


@functools.lru_cache(maxsize=MAX_EXACT_PLAYERS)
def _coefficients(n: int) -> np.ndarray:
    """C [n, 2^n] with phi = C @ U: C[j, T] = w(|T| - 1) if j in T else -w(|T|),
    w(s) = s! (n - s - 1)! / n!."""
    masks = np.arange(1 << n, dtype=np.int64)
    members = (masks[None, :] >> np.arange(n)[:, None]) & 1  # [n, 2^n]
    sizes = members.sum(axis=0)
    weight = np.array(
        [math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)]
        + [0.0]
    )
    coefficients = np.where(members == 1, weight[np.maximum(sizes - 1, 0)], -weight[sizes])
    coefficients.setflags(write=False)
    return coefficients


def shapley_monte_carlo(
    utility,
    n: int,
    *,
    permutations: int,
    generator: torch.Generator | None = None,
    antithetic: bool = True,
) -> Attribution:
    """Monte-Carlo Shapley values from ``permutations`` orderings drawn with ``generator``
    (torch's default when None), with per-player standard errors (module docstring)."""
    if antithetic and (permutations < 4 or permutations % 2):
        raise ValueError(
            f"antithetic sampling needs an even number of permutations >= 4 "
            f"(pairs, two for a standard error), got {permutations}"
        )
    if permutations < 2:
        raise ValueError(f"need permutations >= 2 for a standard error, got {permutations}")
    game = utility if isinstance(utility, Game) else Game(utility, n)
    drawn = permutations // 2 if antithetic else permutations
    orders = torch.rand((drawn, n), generator=generator).argsort(dim=1).numpy()
    if antithetic:
        orders = np.concatenate([orders, orders[:, ::-1]])
    # Coalition before each position of each ordering: [M, n + 1], from ∅ to N.
    prefixes = np.zeros((len(orders), n + 1), dtype=np.int64)
    prefixes[:, 1:] = np.cumsum(np.left_shift(1, orders, dtype=np.int64), axis=1)
    table = game.values(prefixes)
    marginal = np.empty((len(orders), n))
    np.put_along_axis(marginal, orders, np.diff(table, axis=1), axis=1)
    units = (marginal[:drawn] + marginal[drawn:]) / 2 if antithetic else marginal
    se = units.std(axis=0, ddof=1) / math.sqrt(len(units))
    return Attribution(
        marginal.mean(axis=0),
        se,
        game.utility_calls,
        float(table[0, -1]),
        float(table[0, 0]),
        permutations,
    )


def leave_one_out(utility, n: int) -> Attribution:
    """phi_j = U(N) - U(N \\ {j}) (n + 1 coalitions)."""
    game = utility if isinstance(utility, Game) else Game(utility, n)
    everyone = (1 << n) - 1
    table = game.values(np.array([everyone] + [everyone & ~(1 << j) for j in range(n)]))
    empty = float(game.values(np.array([0]))[0])
    return Attribution(
        table[0] - table[1:], np.zeros(n), game.utility_calls, float(table[0]), empty
    )


def independent(utility, n: int) -> Attribution:
    """phi_j = U({j}) - U(∅): each player scored alone."""
    game = utility if isinstance(utility, Game) else Game(utility, n)
    table = game.values(np.array([0] + [1 << j for j in range(n)]))
    full = float(game.values(np.array([(1 << n) - 1]))[0])
    return Attribution(table[1:] - table[0], np.zeros(n), game.utility_calls, full, float(table[0]))


def shapley_naive(utility: Callable[[int], float], n: int) -> np.ndarray:
    """The Shapley formula as a Python loop over players and coalitions, calling the scalar
    ``utility(mask)`` for every term (n 2^n calls, no memo): the benchmark's reference."""
    weight = [math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)]
    phi = np.zeros(n)
    for j in range(n):
        bit = 1 << j
        for mask in range(1 << n):
            if not mask & bit:
                phi[j] += weight[mask.bit_count()] * (utility(mask | bit) - utility(mask))
    return phi


class TableUtility:
    """A utility given as its values on all 2^n coalitions, in mask order."""

    def __init__(self, table: Sequence[float]) -> None:
        self.table = np.asarray(table, dtype=np.float64)
        self.n = len(self.table).bit_length() - 1
        if len(self.table) != 1 << self.n:
            raise ValueError(f"a utility table has 2^n entries, got {len(self.table)}")

    def value(self, mask: int) -> float:
        return float(self.table[mask])

    def values(self, masks: np.ndarray) -> np.ndarray:
        return self.table[np.asarray(masks, dtype=np.int64)]


CORRECT_CLASS = "\x00correct"


def answer_class(answer: str | None, correct: bool) -> str | None:
    """The vote class of a path: every correct answer is one class, a wrong one is its
    normalised spelling, no answer abstains (None)."""
    if answer is None:
        return None
    return CORRECT_CLASS if correct else normalize(answer)


class MajorityVote:
    """Correctness of the majority answer of a coalition of paths (tie rule: module docstring).
    ``answers[j]``: path j's extracted answer (None: no answer, it abstains); ``correct[j]``:
    whether that answer grades correct."""

    def __init__(self, answers: Sequence[str | None], correct: Sequence[bool]) -> None:
        if len(answers) != len(correct):
            raise ValueError(
                f"one correctness per answer: {len(answers)} answers, {len(correct)} grades"
            )
        if any(ok and answer is None for answer, ok in zip(answers, correct)):
            raise ValueError("a path without an answer cannot be correct")
        self.n = len(answers)
        keys = [answer_class(a, ok) for a, ok in zip(answers, correct)]
        classes = sorted({k for k in keys if k is not None}, key=lambda k: k != CORRECT_CLASS)
        self.has_correct_class = CORRECT_CLASS in classes
        # The paths voting for each class, as a bitmask; class 0 is the correct one if present.
        self.class_masks = [sum(1 << j for j, key in enumerate(keys) if key == c) for c in classes]
        self.class_array = np.array(self.class_masks, dtype=np.int64)

    def value(self, mask: int) -> float:
        counts = [(mask & members).bit_count() for members in self.class_masks]
        top = max(counts, default=0)
        if top == 0:
            return 0.0
        tied = sum(count == top for count in counts)
        return 1.0 / tied if self.has_correct_class and counts[0] == top else 0.0

    def values(self, masks: np.ndarray) -> np.ndarray:
        if not self.class_masks:
            return np.zeros(len(masks))
        counts = np.bitwise_count(self.class_array[:, None] & np.asarray(masks, dtype=np.int64))
        top = counts.max(axis=0)  # [coalitions]
        tied = (counts == top).sum(axis=0)
        wins = self.has_correct_class & (counts[0] == top) & (top > 0)
        return np.where(wins, 1.0 / tied, 0.0)


class PassAtK:
    """1 if any path of the coalition is correct (pass@|S|), 0 on ∅."""

    def __init__(self, correct: Sequence[bool]) -> None:
        self.n = len(correct)
        self.correct_mask = sum(1 << j for j, ok in enumerate(correct) if ok)

    def value(self, mask: int) -> float:
        return float(mask & self.correct_mask != 0)

    def values(self, masks: np.ndarray) -> np.ndarray:
        return (np.asarray(masks, dtype=np.int64) & self.correct_mask != 0).astype(np.float64)


class MeanReward:
    """The mean reward of the coalition's paths, 0 on ∅."""

    def __init__(self, rewards: Sequence[float]) -> None:
        self.n = len(rewards)
        self.rewards = np.asarray(rewards, dtype=np.float64)

    def value(self, mask: int) -> float:
        chosen = [r for j, r in enumerate(self.rewards.tolist()) if mask >> j & 1]
        return sum(chosen) / len(chosen) if chosen else 0.0

    def values(self, masks: np.ndarray) -> np.ndarray:
        bits = (np.asarray(masks, dtype=np.int64)[:, None] >> np.arange(self.n)) & 1
        sizes = bits.sum(axis=1)
        return np.where(sizes > 0, bits @ self.rewards / np.maximum(sizes, 1), 0.0)
