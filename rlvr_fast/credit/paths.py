"""Path-level credit for parallel responses (the Parallel-Shapley seed, §3.3), as per-token loss
weights, with the normalisation the reviewers found unspecified written down.

A step has R responses of K paths (``rlvr_fast.rollouts.parallel``). Per response r:

    U_r          its utility on coalitions of its K paths (``PATH_UTILITIES``: "vote", "pass_at_k",
                 "mean_reward" of ``rlvr_fast.credit.shapley``, or "judge", a ``GenerativeJudge``)
    phi_r        the paths' credit under ``path_credit``: "shapley" (exact when permutations is
                 0, else Monte-Carlo with M = permutations), "loo" (U(N) - U(N \\ {j})) or
                 "independent" (U({j}) - U(∅))
    r_out,r      the outcome reward: the vote aggregator's is the majority vote's correctness
                 (``MajorityVote`` on all K paths: 1/c on a c-way tie that includes the correct
                 answer), the summary aggregator's is the summary's grade (0 or 1)

Returns (the reward-to-go of a token; the summary follows every path of its response, so its
outcome reward is in every path's return; the vote has no tokens, its reward lands the same way):

    path tokens of (r, j):   R_rj = lambda_p * normalise(phi_r)_j + lambda_o * r_out,r
    summary tokens of r:     S_r  = lambda_o * r_out,r

``normalise`` (``path_reward_norm``), over the K paths of one response:
    "zscore"  (phi_j - mean phi) / (std phi + 1e-4), std Bessel-corrected (default: GRPO's rule,
              within the response, so paths compete with their siblings)
    "center"  phi_j - mean phi
    "none"    phi_j as computed (for Shapley, sum_j phi_j = U(N) - U(∅))
Advantages, GRPO's rule per kind of token: path tokens (R_rj - mean R) / (std R + 1e-4) over the
step's R K path returns; summary tokens (S_r - mean S) / (std S + 1e-4) over its R summary
returns (``credit.group_stats``, float32 as everywhere in the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from rlvr_fast.credit.group import ADVANTAGE_EPS, group_stats
from rlvr_fast.credit.shapley import (
    Attribution,
    Game,
    MajorityVote,
    MeanReward,
    PassAtK,
    independent,
    leave_one_out,
    shapley_exact,
    shapley_monte_carlo,
)

PATH_UTILITIES = ("vote", "pass_at_k", "mean_reward", "judge")
PATH_CREDITS = ("shapley", "loo", "independent")
PATH_REWARD_NORMS = ("zscore", "center", "none")
MAX_STORED_TABLE_PLAYERS = 10  # 1,024 coalitions: beyond that a run keeps phi, not the table


def outcome_utility(name: str, answers: Sequence[str | None], correct: Sequence[bool]):
    """One of the outcome-derived utilities on K paths' answers and grades."""
    if name == "vote":
        return MajorityVote(answers, correct)
    if name == "pass_at_k":
        return PassAtK(correct)
    if name == "mean_reward":
        return MeanReward([float(ok) for ok in correct])
    raise ValueError(f"unknown outcome utility {name!r} (valid: vote, pass_at_k, mean_reward)")


def attribute(
    utility,
    n: int,
    method: str,
    *,
    permutations: int = 0,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[Attribution, list[float] | None]:
    """phi of ``utility`` on n paths by ``method``, and U over all 2^n coalitions (mask order)
    when the method scored them all and n <= MAX_STORED_TABLE_PLAYERS (else None)."""
    game = Game(utility, n)
    if method == "shapley" and permutations == 0:
        result = shapley_exact(game, n)
    elif method == "shapley":
        result = shapley_monte_carlo(
            game, n, permutations=permutations, generator=generator, antithetic=antithetic
        )
    elif method == "loo":
        result = leave_one_out(game, n)
    elif method == "independent":
        result = independent(game, n)
    else:
        raise ValueError(f"path_credit must be one of {', '.join(PATH_CREDITS)}, got {method!r}")
    whole = game.utility_calls == 1 << n and n <= MAX_STORED_TABLE_PLAYERS
    table = game.all_values().tolist() if whole else None
    return result, table


def normalise(phi: np.ndarray, norm: str) -> torch.Tensor:
    values = torch.tensor(phi, dtype=torch.float32)
    if norm == "none":
        return values
    if norm not in PATH_REWARD_NORMS:
        raise ValueError(
            f"path_reward_norm must be one of {', '.join(PATH_REWARD_NORMS)}, got {norm!r}"
        )
    centred = values - values.mean()
    if norm == "center" or len(values) < 2:
        return centred
    return centred / (values.std() + ADVANTAGE_EPS)


def standardise(returns: torch.Tensor) -> tuple[torch.Tensor, float]:
    """GRPO's (R - mean R) / (std R + 1e-4); zeros (sigma 0) for fewer than two returns."""
    if len(returns) < 2:
        return torch.zeros_like(returns), 0.0
    mean, sigma = group_stats(returns)
    return (returns - mean) / (sigma + ADVANTAGE_EPS), float(sigma)


@dataclass
class ParallelCredit:
    """A step's credit: per response its ``attributions`` and ``r_out``; per path its return and
    advantage (response-major); per summary the same (empty under the vote aggregator)."""

    attributions: list[Attribution]
    tables: list[list[float] | None]
    r_out: list[float]
    path_returns: torch.Tensor
    path_advantages: torch.Tensor
    summary_returns: torch.Tensor
    summary_advantages: torch.Tensor
    sigma: float

    @property
    def phi(self) -> list[float]:
        return [float(x) for a in self.attributions for x in a.phi]

    @property
    def utility_calls(self) -> int:
        return sum(a.utility_calls for a in self.attributions)

    @property
    def homogeneous(self) -> bool:
        """No token has a nonzero advantage: every path return agrees, and every summary's."""
        return bool((self.path_advantages == 0).all() and (self.summary_advantages == 0).all())

    def token_weights(
        self, path_lengths: Sequence[int], summary_lengths: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-token weights of every path and every summary (one advantage per sequence)."""
        return (
            [a.expand(n) for a, n in zip(self.path_advantages, path_lengths)],
            [a.expand(n) for a, n in zip(self.summary_advantages, summary_lengths)],
        )


def parallel_credit(
    utilities: Sequence,
    r_out: Sequence[float],
    paths_per_response: int,
    *,
    method: str = "shapley",
    permutations: int = 0,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
    norm: str = "zscore",
    lambda_outcome: float = 0.5,
    lambda_path: float = 0.5,
    summaries: bool = False,
) -> ParallelCredit:
    """The credit of R responses (module docstring): ``utilities[r]`` scores coalitions of
    response r's K paths, ``r_out[r]`` is its outcome reward; ``summaries``: whether responses
    end in summary tokens."""
    if len(utilities) != len(r_out):
        raise ValueError(
            f"one outcome reward per response: {len(utilities)} utilities, {len(r_out)} rewards"
        )
    attributions, tables, returns = [], [], []
    for utility, outcome in zip(utilities, r_out):
        result, table = attribute(
            utility,
            paths_per_response,
            method,
            permutations=permutations,
            antithetic=antithetic,
            generator=generator,
        )
        attributions.append(result)
        tables.append(table)
        returns.append(lambda_path * normalise(result.phi, norm) + lambda_outcome * outcome)
    path_returns = torch.cat(returns)
    path_advantages, sigma = standardise(path_returns)
    summary_returns = (
        lambda_outcome * torch.tensor(r_out, dtype=torch.float32) if summaries else torch.zeros(0)
    )
    summary_advantages, _ = standardise(summary_returns)
    return ParallelCredit(
        attributions,
        tables,
        [float(r) for r in r_out],
        path_returns,
        path_advantages,
        summary_returns,
        summary_advantages,
        sigma,
    )
