"""The trainer's task for a TRL script: prompts from the dataset's ``prompt`` column and rewards
from TRL-style reward functions, called exactly as TRL calls them:

    reward_func(prompts=[...] * G, completions=[...], completion_ids=[[...]], <every other
                dataset column but "completion" and "completion_ids", repeated G times>,
                trainer_state=state, log_extra=..., log_metric=...)

Prompts and completions are strings for plain-text prompts and message lists for conversational
ones (a completion is then ``[{"role": "assistant", "content": text}]``). A function returns one
float, or None, per completion; rewards are weighted by ``reward_weights`` and summed with None
read as missing (a completion every function leaves unscored gets NaN, and no advantage).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from rlvr_fast.data.problems import Problem
from rlvr_fast.grading import passes_gate


def is_conversational(prompt) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


def callable_name(func) -> str:
    """A reward function's name in logged keys (rewards/NAME/mean): partials by the wrapped
    function, callable objects by their class, as TRL names them."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


@dataclass
class ScoredGroup:
    """The last step's dataset row, and what its reward functions returned: [G, F] with NaN
    for None, and the weighted sums [G]."""

    row: int
    per_function: torch.Tensor
    rewards: torch.Tensor
    completion_ids: list[list[int]]


class RewardFunctionsTask:
    """Prompt ids and rewards for ``rlvr_fast.train.trainer.RLVRTrainer`` from dataset rows.
    ``Problem.id`` is the row's index; ``encode(prompt)`` gives a row's prompt ids."""

    def __init__(
        self,
        rows: list[dict],
        reward_funcs: list,
        weights: list[float],
        encode,
        *,
        gate_min_chars: int | None,
        trainer_state,
        log_metric,
    ) -> None:
        self.rows, self.reward_funcs = rows, reward_funcs
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.encode, self.gate_min_chars = encode, gate_min_chars
        self.trainer_state, self.log_metric = trainer_state, log_metric
        self.encoded: dict[int, list[int]] = {}
        self.last: ScoredGroup | None = None

    def problems(self) -> list[Problem]:
        return [
            Problem(
                id=str(i),
                question=str(row["prompt"]),
                answer=str(row.get("answer", "")),
                source="dataset",
            )
            for i, row in enumerate(self.rows)
        ]

    def prompt_ids(self, problem: Problem) -> list[int]:
        index = int(problem.id)
        if index not in self.encoded:
            self.encoded[index] = self.encode(self.rows[index]["prompt"])
        return self.encoded[index]

    def rewards(
        self, problem: Problem, texts: list[str], completions: list[list[int]]
    ) -> list[float]:
        row = self.rows[int(problem.id)]
        group = len(texts)
        conversational = is_conversational(row["prompt"])
        prompts = [copy.deepcopy(row["prompt"]) for _ in range(group)]
        answers = (
            [[{"role": "assistant", "content": t}] for t in texts]
            if conversational
            else list(texts)
        )
        columns = {
            key: [row[key]] * group
            for key in row
            if key not in ("prompt", "completion", "completion_ids")
        }
        ids = [list(c) for c in completions]
        per_function = torch.empty(group, len(self.reward_funcs))
        for index, func in enumerate(self.reward_funcs):
            out = func(
                prompts=prompts,
                completions=answers,
                completion_ids=ids,
                **columns,
                trainer_state=self.trainer_state,
                log_extra=discard_extra_column,
                log_metric=self.log_metric,
            )
            if len(out) != group:
                raise ValueError(
                    f"reward function {callable_name(func)!r} returned {len(out)} "
                    f"rewards for {group} completions"
                )
            per_function[:, index] = torch.tensor(
                [float("nan") if r is None else float(r) for r in out], dtype=torch.float32
            )
        rewards = (per_function * self.weights).nansum(dim=1)
        rewards[per_function.isnan().all(dim=1)] = float("nan")
        if self.gate_min_chars is not None:
            # The study's derivation gate (an arm's gate_min_chars) on the summed reward.
            rewards *= torch.tensor(
                [passes_gate(t, self.gate_min_chars) for t in texts], dtype=torch.float32
            )
        self.last = ScoredGroup(int(problem.id), per_function, rewards, ids)
        return rewards.tolist()


def discard_extra_column(column: str, values: list) -> None:
    """TRL's ``log_extra``: its columns only reach TRL's completions table (log_completions),
    which rlvr_fast does not write."""
