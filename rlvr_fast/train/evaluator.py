"""Evaluation during a run: greedy decoding of every eval set on the run's engine, sharded over
the ranks of a data-parallel run, written under evals/ (``RunLayout``). The evaluation before
training is checkpointed, so that a resumed run's summary still reports it."""

from __future__ import annotations

import json
from typing import Sequence

from rlvr_fast.data.problems import Problem
from rlvr_fast.rollouts.evaluation import EvalResult
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.train import distributed
from rlvr_fast.utils.files import write_text_atomic


class Evaluator:
    def __init__(
        self,
        policy,
        eval_data: dict[str, Sequence[Problem]],
        engine,
        *,
        max_new_tokens: int,
        progress: bool,
        layout: RunLayout | None,
    ) -> None:
        self.policy, self.eval_data, self.engine = policy, eval_data, engine
        self.max_new_tokens, self.progress, self.layout = max_new_tokens, progress, layout
        self.before: dict | None = None

    def run(self, label: str) -> dict[str, dict]:
        """Evaluate every set (``label``: before, after or polyak); the summaries by set."""
        summaries = {}
        for name, problems in self.eval_data.items():
            result: EvalResult = distributed.evaluate_sharded(
                self.policy,
                problems,
                max_new_tokens=self.max_new_tokens,
                progress=self.progress,
                desc=f"eval {name} ({label})",
                engine=self.engine,
            )
            summaries[name] = result.summary()
            if self.layout is not None:
                write_text_atomic(
                    self.layout.eval_file(name, label),
                    "".join(json.dumps(i.to_json()) + "\n" for i in result.items),
                )
        if label == "before":
            self.before = summaries
        return summaries

    def state_dict(self) -> dict | None:
        return self.before

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None and not isinstance(state, dict):
            raise ValueError("eval_before is not a mapping")
        self.before = state
