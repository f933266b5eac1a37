"""What every step kind shares: the protocol the trainer and ``verify`` use, and the record of
one question as it passes through its kind.

A kind turns a step's questions into rollouts (on the run's engine, through its planner),
credits them, gives the loss of each, and writes what the ledger and ``verify`` read:

    kind.sample(questions, bases, active_steps=n)   # question.rollouts (one engine batch)
    kind.credit(questions, phase)                    # question.credit: rewards and weights
    kind.contributes(question)                       # its rewards vary: its gradient counts
    kind.loss(question)                              # the forward pass of its loss
    kind.loss_count(question)                        # what that loss averages over
    kind.step_normaliser(questions)                  # flat kinds: a pooled step's divisor
    kind.measure(questions, phase)                   # figures of those whose loss won't run
    kind.figures(questions, micro_batches)           # TRL's entropy / KL / clip figures
                                                     # (over_ranks=True: every rank's)
    kind.reference                                   # the KL's reference model, or None
    kind.entropy_control                             # TRL's adaptive entropy control, or None
    kind.record(step, question, ...)                 # its ledger record (checked)
    kind.rollouts_line(step, question)               # what verify re-derives the record from
    Kind.rederive(line, recorded, config, params, active_steps)   # verify's record

A step of several questions (``questions_per_step``) is not a kind: ``rlvr_fast.train.steps``
combines the questions' results into one line. Whether the step runs a backward pass and an
optimizer step is ``rlvr_fast.train.decision``'s rule, shared by the trainer and ``verify``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from rlvr_fast.data.problems import Problem
from rlvr_fast.engine import EngineCounters
from rlvr_fast.grading import final_answer, grade_many
from rlvr_fast.ledger.records import StepRecord
from rlvr_fast.utils.phases import Phases


@dataclass
class Question:
    """One question of a step: its problem and prompt, then what its kind sampled (``rollouts``)
    and credited (``credit``), and on a step of generation_steps > 1 the completions that step
    trains on (``share``, leaf order; None: all)."""

    problem: Problem
    prompt_ids: list[int]
    rollouts: object = None
    credit: object = None
    share: list[int] | None = None


@dataclass(frozen=True)
class RecordInputs:
    """What a question's ledger record takes from its step beyond the question itself."""

    step: int
    active: bool
    optimizer_step: bool
    loss: float | None
    grad_norm: float | None
    seconds: dict[str, float]
    executed: EngineCounters
    iteration: int = 0  # > 0: an update on an earlier step's rollouts (num_iterations)


class StepKind(Protocol):
    name: ClassVar[str]
    reference: torch.nn.Module | None
    entropy_control: object | None  # rlvr_fast.train.policy.EntropyControl

    @classmethod
    def check_config(cls, config) -> None: ...

    @classmethod
    def check_task(cls, task) -> None: ...

    def sample(
        self, questions: list[Question], bases: list[int] | None, *, active_steps: int
    ) -> None: ...

    def credit(self, questions: list[Question], phase: Phases) -> None: ...

    def contributes(self, question: Question) -> bool: ...

    def loss(self, question: Question) -> torch.Tensor: ...

    def loss_count(self, question: Question) -> int: ...

    def measure(self, questions: list[Question], phase: Phases) -> None: ...

    def figures(
        self,
        questions: list[Question],
        micro_batches: list[list[int]] | None = None,
        *,
        over_ranks: bool = False,
    ) -> dict[str, float]: ...

    def record(self, question: Question, inputs: RecordInputs) -> StepRecord: ...

    def rollouts_line(self, step: int, question: Question) -> dict: ...

    def rewards(self, question: Question) -> list[float]: ...

    def texts(self, question: Question) -> list[str]: ...

    def executed(self, question: Question) -> EngineCounters: ...

    @classmethod
    def rederive(
        cls, line: dict, recorded: dict, config, params: int, active_steps: int, *, regrade=True
    ) -> StepRecord: ...


def require_token_weighted(config, arms: str) -> None:
    if config.loss_order != "token_weighted":
        raise ValueError(f"{arms} arms weight every token, so they need loss_order token_weighted")


def regraded(texts: list[str], answer: str, gate_min_chars: int | None) -> tuple[list, list[bool]]:
    """The study's grading of ``texts`` (the last boxed answer, with the derivation gate)."""
    answers = [final_answer(text, min_chars=gate_min_chars) for text in texts]
    return answers, grade_many(answers, [answer] * len(answers))


def record_arguments(question: Question, inputs: RecordInputs, config, params: int) -> dict:
    """The record arguments every kind's ledger record takes from the step and the question."""
    return dict(
        step=inputs.step,
        question_id=question.problem.id,
        active=inputs.active,
        optimizer_step=inputs.optimizer_step,
        prompt_len=len(question.prompt_ids),
        executed=inputs.executed,
        max_new_tokens=config.max_new_tokens,
        params=params,
        loss=inputs.loss,
        grad_norm=inputs.grad_norm,
        seconds=inputs.seconds,
    )


def recorded_rewards(recorded: dict, group: int) -> list[float | None]:
    """A ledger line's rewards, taken as given: one number (or null, unscored) per text."""
    rewards = recorded.get("rewards")
    if not (
        isinstance(rewards, list)
        and len(rewards) == group
        and all(
            r is None or (isinstance(r, (int, float)) and not isinstance(r, bool)) for r in rewards
        )
    ):
        raise ValueError(f"the ledger's rewards are not {group} numbers or nulls")
    return rewards


def recorded_inputs(line: dict, recorded: dict, config, params: int) -> dict:
    """The record arguments of a re-derived step that come from the rollouts line, the config
    and, for what nothing on disk determines (engine counts, timings, loss, gradient norm), the
    recorded ledger line."""
    return dict(
        step=line["step"],
        question_id=line["question_id"],
        prompt_len=line["prompt_len"],
        max_new_tokens=config.max_new_tokens,
        params=params,
        loss=recorded.get("loss"),
        grad_norm=recorded.get("grad_norm"),
        seconds=recorded.get("seconds", {}),
        executed=EngineCounters(
            **{f.name: recorded.get(f.name) for f in dataclasses.fields(EngineCounters)}
        ),
    )
