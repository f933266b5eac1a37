"""How a step's questions are combined into its update and become its ledger and rollouts lines,
forward (the trainer) and back (``verify``). A step of one question is its kind's record; a
multi-question step (``questions_per_step`` Q > 1) is not a kind of its own but a combination,
``combine_questions``:
- ``unit_norm`` (the accum4 ablation): each contributing question's gradient scaled to unit L2
  norm, the Q averaged (``OptimizerStepping.accumulate_unit_gradients``);
- ``pooled`` (TRL's several prompts per optimizer step): one loss over all the step's
  completions, sum_q c_q L_q with c_q = n_q / sum_r n_r (``pooled_weights``), n_q what question
  q's own loss L_q averages over (``kind.loss_count``: its tokens under dapo, else its
  completions), summed over every question of the step on every rank, zero-variance ones
  included (they add tokens to dapo's count but no gradient, so they run no backward).
  Under dapo that is TRL's sum over the step's tokens over their number, under grpo and dr_grpo
  its mean over the step's completions.
A generation of ``generation_steps`` S > 1 (TRL's steps_per_generation beyond its
gradient_accumulation_steps) serves S optimizer steps (times num_iterations): its completions,
question-major, are shuffled by a permutation seeded by the run's seed and the generation's index
(``generation_shares``, which ``verify`` re-derives), and step k of the generation trains on the
k-th 1/S of them, each question on its ``share``. Pooled, every step's loss is then TRL's sum
over its micro-batches: the mean over the step's completions (grpo, dr_grpo, luspo, sapo), over
its tokens (bnpo, one micro-batch per step), or (dapo, cispo) the step's token sum over the
generation's tokens / S, TRL's num_items_in_batch rescaled to one optimizer step.
Either way one ``MultiQuestionRecord`` holds each question's record (its loss, and under
unit_norm its gradient norm, before the combination; no timings or engine counts: the Q
questions are sampled in one batch, whose work is the step's), gathered over the ranks of a
data-parallel run in question order."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from rlvr_fast.engine import EngineCounters
from rlvr_fast.ledger.records import LedgerRecord, multi_question_step_record
from rlvr_fast.train import distributed
from rlvr_fast.train.decision import StepDecision, decide_step
from rlvr_fast.train.kinds import Question, RecordInputs, StepKind
from rlvr_fast.train.stepping import Update


QUESTION_COMBINATIONS = ("unit_norm", "pooled")


def pooled_weights(kind: StepKind, questions: list[Question], contributing: list[Question]):
    """c_q = n_q / N of each ``contributing`` question (of this rank), N the kind's
    ``step_normaliser`` summed over every rank (an all_reduce): sum n over every question of
    the step, or under generation_steps S > 1 what module docstring says, n_q then counting
    the question's share."""
    total = distributed.sum_over_ranks(kind.step_normaliser(questions))
    return [kind.loss_count(q) / max(total, 1) for q in contributing]


def generation_order(seed: int, generation: int, completions: int) -> list[int]:
    """The shuffle of generation ``generation``'s ``completions`` (TRL's
    ``shuffle_sequence_dict``, from a generator of its own seeded by the run's seed and the
    generation)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + generation)
    return torch.randperm(completions, generator=generator).tolist()


def generation_shares(
    sizes: list[int], seed: int, generation: int, steps: int, index: int
) -> list[list[int]]:
    """The completions step ``index`` (of ``steps``) of generation ``generation`` trains on, per
    question of ``sizes`` completions: the ``index``-th 1/steps of a permutation of all of them
    (question-major) drawn from a generator seeded by (``seed``, ``generation``), each
    question's in leaf order. The run's own generator is not drawn from."""
    total = sum(sizes)
    order = generation_order(seed, generation, total)
    per_step = total // steps
    chosen = sorted(order[index * per_step : (index + 1) * per_step])
    shares, start = [], 0
    for size in sizes:
        shares.append([i - start for i in chosen if start <= i < start + size])
        start += size
    return shares


def share_of_step(config, step: int, sizes: list[int]) -> list[list[int]] | None:
    """``generation_shares`` of step ``step`` of a run (None: every step trains on its whole
    generation)."""
    steps = config.generation_steps
    if steps == 1:
        return None
    generation = step // (steps * config.num_iterations)
    return generation_shares(sizes, config.seed, generation, steps, step % steps)


@dataclass
class StepResult:
    """One step's rewards and texts (every question's, in order), its ledger record and its
    rollouts line."""

    rewards: list[float]
    texts: list[str]
    ledger_record: LedgerRecord
    line: dict

    @functools.cached_property
    def record(self) -> dict:
        """The ledger line as written."""
        return self.ledger_record.to_json()


def single_question_step(
    kind: StepKind,
    question: Question,
    step: int,
    decision: StepDecision,
    update: Update,
    seconds: dict[str, float],
    iteration: int = 0,
) -> StepResult:
    """The step's line; ``iteration`` > 0: an update on rollouts sampled at an earlier step
    (``num_iterations``), which executed no engine work."""
    inputs = RecordInputs(
        step,
        decision.active,
        decision.optimizer_step,
        update.loss,
        update.grad_norm,
        seconds,
        kind.executed(question) if iteration == 0 else EngineCounters(),
        iteration,
    )
    return StepResult(
        kind.rewards(question),
        kind.texts(question),
        kind.record(question, inputs),
        rollouts_line(kind, step, question, iteration),
    )


def rollouts_line(kind: StepKind, step: int, question: Question, iteration: int) -> dict:
    """The question's rollouts line, with its update ``iteration`` when > 0."""
    line = kind.rollouts_line(step, question)
    if iteration:
        line["iteration"] = iteration
    return line


def multi_question_step(
    kind: StepKind,
    questions: list[Question],
    step: int,
    decision: StepDecision,
    update: Update,
    seconds: dict[str, float],
    iteration: int = 0,
) -> StepResult:
    """The step's line from this rank's ``questions`` and every other rank's (``iteration``
    as ``single_question_step``'s)."""
    contributing = [index for index, q in enumerate(questions) if kind.contributes(q)]
    losses = dict(zip(contributing, update.question_losses))
    norms = dict(zip(contributing, update.question_grad_norms))
    records = [
        kind.record(
            question,
            RecordInputs(
                step,
                index in losses,
                decision.optimizer_step,
                losses.get(index),
                norms.get(index),
                {},
                EngineCounters(),
                iteration,
            ),
        )
        for index, question in enumerate(questions)
    ]
    lines = [rollouts_line(kind, step, question, iteration) for question in questions]
    executed = kind.executed(questions[0]) if iteration == 0 else EngineCounters()
    records, lines, executed, loss = distributed.gather_step(records, lines, executed, update.loss)
    record = multi_question_step_record(
        step=step,
        questions=records,
        active=decision.active,
        optimizer_step=decision.optimizer_step,
        executed=executed,
        loss=loss,
        grad_norm=update.grad_norm,
        seconds=seconds,
    )
    return StepResult(
        [r for line in lines for r in line["rewards"]],
        [t for line in lines for t in line["texts"]],
        record,
        {"step": step, "questions": lines},
    )


def rederive_step(
    kind: type,
    line: dict,
    recorded: dict,
    config,
    params: int,
    active_steps: int,
    *,
    regrade: bool = True,
) -> LedgerRecord:
    """The ledger line step ``line["step"]`` should have, given ``active_steps`` backward
    steps before it: its kind's record re-derived, or on a multi-question step each question's,
    stepped by the step's decision. ``regrade=False`` takes the recorded rewards as given (a
    task's own reward functions cannot be re-run)."""
    if config.questions_per_step == 1:
        shares = share_of_step(config, line["step"], [len(line["lengths"])])
        if shares is not None:
            line = dict(line, trained=shares[0])
        return kind.rederive(line, recorded, config, params, active_steps, regrade=regrade)
    if len(line["questions"]) != len(recorded["questions"]):
        raise ValueError(
            f"rollouts.jsonl has {len(line['questions'])} questions, the ledger "
            f"{len(recorded['questions'])}"
        )
    if len(line["questions"]) != config.questions_per_step:
        raise ValueError(
            f"{len(line['questions'])} questions, config.json says "
            f"{config.questions_per_step} per step"
        )
    shares = share_of_step(config, line["step"], [len(q["lengths"]) for q in line["questions"]])
    questions = [
        kind.rederive(
            dict(question, step=line["step"], trained=None if shares is None else shares[index]),
            recorded_question,
            config,
            params,
            active_steps,
            regrade=regrade,
        )
        for index, (question, recorded_question) in enumerate(
            zip(line["questions"], recorded["questions"])
        )
    ]
    # Each question's own decision says whether it contributes (its rewards vary or a KL term
    # pulls it, and the step trains on it): multi-question steps skip zero-variance ones.
    decision = decide_step(
        sum(q.active for q in questions),
        skip_zero_var=config.skip_zero_var,
        zero_var_step=config.zero_var_step,
    )
    executed = EngineCounters(
        **{f.name: recorded.get(f.name) for f in dataclasses.fields(EngineCounters)}
    )
    return multi_question_step_record(
        step=line["step"],
        questions=[
            dataclasses.replace(q, optimizer_step=decision.optimizer_step) for q in questions
        ],
        active=decision.active,
        optimizer_step=decision.optimizer_step,
        executed=executed,
        loss=recorded.get("loss"),
        grad_norm=recorded.get("grad_norm"),
        seconds=recorded.get("seconds", {}),
    )
