"""The settings of parallel-path arms: paths per response, their aggregation, and the credit
of a path (Shapley values, leave-one-out, alone) mixed into its reward
(``rlvr_fast.rollouts.parallel``, ``rlvr_fast.credit.paths``, ``rlvr_fast.credit.shapley``), a
component of ``TrainConfig`` (``config.paths``)."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.credit.paths import PATH_CREDITS, PATH_REWARD_NORMS, PATH_UTILITIES
from rlvr_fast.credit.shapley import MAX_PERMUTATIONS, MAX_PLAYERS
from rlvr_fast.rollouts.parallel import AGGREGATORS
from rlvr_fast.utils.settings import must_be_one_of, one_of, setting


@dataclass
class PathsConfig:
    num_paths: int = setting(
        4,
        "paths per response (K) of parallel arms",
        lambda v: 1 <= v <= MAX_PLAYERS,
        f"num_paths must be in [1, {MAX_PLAYERS}], got {{value}}",
    )
    aggregator: str = setting(
        "vote",
        "how a response aggregates its paths: majority vote, or a generated summary",
        one_of(AGGREGATORS),
        must_be_one_of("aggregator", AGGREGATORS),
    )
    path_utility: str = setting(
        "vote",
        "utility of a coalition of paths",
        one_of(PATH_UTILITIES),
        must_be_one_of("path_utility", PATH_UTILITIES),
    )
    path_credit: str = setting(
        "shapley",
        "credit of a path: its Shapley value, leave-one-out, or graded alone",
        one_of(PATH_CREDITS),
        must_be_one_of("path_credit", PATH_CREDITS),
    )
    shapley_permutations: int = setting(
        0,
        "Monte-Carlo permutations of Shapley credit (0: exact)",
        lambda v: 0 <= v <= MAX_PERMUTATIONS,
        f"shapley_permutations must be in [0, {MAX_PERMUTATIONS}] (0: exact)",
        also=(lambda v: v != 1, "Monte-Carlo Shapley needs shapley_permutations >= 2"),
    )
    shapley_antithetic: bool = setting(True, "Monte-Carlo orderings in antithetic pairs")
    path_reward_norm: str = setting(
        "zscore",
        "normalisation of phi before it is mixed into the path reward",
        one_of(PATH_REWARD_NORMS),
        must_be_one_of("path_reward_norm", PATH_REWARD_NORMS),
    )
    lambda_outcome: float = setting(
        0.5,
        "weight of the outcome reward in a path's reward",
        lambda v: v >= 0,
        "lambda_outcome and lambda_path must be >= 0",
    )
    lambda_path: float = setting(
        0.5,
        "weight of the normalised Shapley value in a path's reward",
        lambda v: v >= 0,
        "lambda_outcome and lambda_path must be >= 0",
    )
    judge_model: str = setting(
        "policy", "the judge of path_utility judge: the policy, or a model directory"
    )
