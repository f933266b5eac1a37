"""Grading throughput: one call per item (the eager side) vs ``grade_many`` (the fast side).

Two workloads, each a fresh batch every round, with the normalisation cache cleared, so no
round is graded from what an earlier one left behind:

* synthetic -- 800 responses to the embedded synthetic task (worked derivations with the
  right answer and with a wrong one, bare guesses that fail the 30-char gate, truncated ones
  without a closed box): what the trainer grades on CPU.  The caller settles every item.
* worker -- 24 answers only a worker can settle: radicals and polynomials (sympy) and
  binomials (math-verify's second opinion); ``grade_many`` runs one worker per CPU core, so
  on the 2-core machine it gains at most about 2x.

The summary prints items/s for each side.
"""

from __future__ import annotations

import itertools
import os

import pytest

from benchmarks.harness import mark
from rlvr_fast.data.synthetic import synthetic_problems, worked_solution
from rlvr_fast.grading import final_answer, grade, grade_many, grade_response
from rlvr_fast.grading.normalisation import normalize
from rlvr_fast.grading.pool import POOL

GATE = 30
WORKER_ITEMS = 24
_ROUND = itertools.count()


def synthetic_batch() -> tuple[list[str], list[str]]:
    texts, golds = [], []
    for problem in synthetic_problems("train", 200, seed=next(_ROUND)):
        derivation = worked_solution(problem, "derive")
        wrong = f"\\boxed{{{int(problem.answer) + 1}}}"
        texts += [
            derivation,
            derivation.replace(f"\\boxed{{{problem.answer}}}", wrong),
            worked_solution(problem, "guess"),
            derivation[:-10],
        ]
        golds += [problem.answer] * 4
    return texts, golds


def worker_batch() -> tuple[list[str], list[str]]:
    start = 2 + next(_ROUND) * WORKER_ITEMS
    preds, golds = [], []
    for k in range(start, start + WORKER_ITEMS // 3):
        preds += [f"{k}\\sqrt{{3}}", f"(x+{k})^2", f"\\binom{{{k}}}{{2}}"]
        golds += [f"\\sqrt{{{3 * k * k}}}", f"x^2+{2 * k}x+{k * k}", str(k * (k - 1) // 2)]
    return preds, golds


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_grading_synthetic(benchmark, role):
    def setup():
        normalize.cache_clear()
        return synthetic_batch(), {}

    def run(texts, golds):
        if role == "eager":
            verdicts = [
                grade_response(text, gold, min_chars=GATE) for text, gold in zip(texts, golds)
            ]
        else:
            verdicts = grade_many([final_answer(text, min_chars=GATE) for text in texts], golds)
        assert sum(verdicts) == len(texts) // 4  # only the right derivations

    mark(benchmark, "grading-synthetic", role, work=800, unit="items")
    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_grading_worker(benchmark, role):
    POOL.reserve(os.cpu_count() or 1)  # the pool's start-up is not what is measured

    def setup():
        normalize.cache_clear()
        return worker_batch(), {}

    def run(preds, golds):
        if role == "eager":
            verdicts = [grade(pred, gold) for pred, gold in zip(preds, golds)]
        else:
            verdicts = grade_many(preds, golds)
        assert all(verdicts), [p for p, v in zip(preds, verdicts) if not v]

    mark(benchmark, "grading-worker", role, work=WORKER_ITEMS, unit="items")
    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)
