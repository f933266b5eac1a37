"""Shapley values and the generative judge beside their references, in the same run.

1. Exact Shapley with the majority-vote utility, n = 4, 8, 12 paths (answers drawn from 4
   classes, one of them correct): ``shapley_exact`` (the utility built and all 2^n coalitions
   scored in one batch, phi = C_n @ U) vs ``shapley_naive`` (the formula as a Python loop over
   players and coalitions, one scalar utility call per term). For n = 4 and 8 also the
   definition itself, a Python loop over all n! orderings (n = 12 has 479M of them).
2. ``GenerativeJudge`` on the tiny model, K = 4 and 6 paths of sampled text: all 2^K coalitions
   scored in batched prefill passes from one shared prefix vs one coalition at a time (each
   prompt prefilled whole); coalitions/s.
Correctness is asserted in ``tests/credit/test_shapley.py`` and ``tests/rollouts/test_parallel.py``.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.rollouts.generation import sample_group
from rlvr_fast.credit.judge import GenerativeJudge
from rlvr_fast.models.policy import load_policy
from rlvr_fast.credit.shapley import MajorityVote, shapley_exact, shapley_naive


def vote_paths(n: int) -> tuple[list[str], list[bool]]:
    rng = random.Random(n)
    answers = [rng.choice(["42", "41", "24", "7"]) for _ in range(n)]
    return answers, [a == "42" for a in answers]


def by_orderings(utility, n: int) -> np.ndarray:
    phi = np.zeros(n)
    orders = itertools.permutations(range(n))
    count = 0
    for order in orders:
        mask = 0
        for j in order:
            phi[j] += utility(mask | 1 << j) - utility(mask)
            mask |= 1 << j
        count += 1
    return phi / count


@pytest.mark.parametrize("n", [4, 8, 12])
@pytest.mark.parametrize("role", ["eager", "fast"])
def test_shapley_exact_vote(benchmark, n, role):
    answers, correct = vote_paths(n)
    if role == "fast":
        run = lambda: shapley_exact(MajorityVote(answers, correct), n)  # noqa: E731
    else:
        run = lambda: shapley_naive(MajorityVote(answers, correct).value, n)  # noqa: E731
    mark(benchmark, f"shapley-exact-vote-n{n}", role, work=1, unit="games")
    benchmark.pedantic(run, rounds=5 if n == 12 else 20, warmup_rounds=1)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("role", ["eager", "fast"])
def test_shapley_exact_vote_vs_orderings(benchmark, n, role):
    answers, correct = vote_paths(n)
    if role == "fast":
        run = lambda: shapley_exact(MajorityVote(answers, correct), n)  # noqa: E731
    else:
        run = lambda: by_orderings(MajorityVote(answers, correct).value, n)  # noqa: E731
    mark(benchmark, f"shapley-exact-vote-n{n}-orderings", role, work=1, unit="games")
    benchmark.pedantic(run, rounds=3 if n == 8 and role == "eager" else 20, warmup_rounds=0)


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


@pytest.mark.parametrize("paths", [4, 6])
@pytest.mark.parametrize("role", ["eager", "fast"])
def test_judge_coalitions(benchmark, tiny, paths, role):
    problem = synthetic_problems("test", 1)[0]
    prompt = tiny.tokenizer.encode(render_prompt(problem.question))
    rollouts = sample_group(
        RolloutEngine.shared(tiny),
        prompt,
        paths,
        SamplingParams(64),
        generator=torch.Generator().manual_seed(0),
    )
    game = GenerativeJudge(tiny).game(
        problem.question, problem.answer, tiny.tokenizer.decode_batch(rollouts.tokens)
    )
    masks = np.arange(1 << paths)
    if role == "fast":
        run = lambda: game.values(masks)  # noqa: E731
    else:
        run = lambda: [game.value(int(m)) for m in masks]  # noqa: E731
    mark(benchmark, f"judge-coalitions-k{paths}", role, work=len(masks), unit="coalitions")
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
