"""Parallel-path steps (the Parallel-Shapley seed): ``group_size`` responses of ``num_paths``
paths each, forked from one prompt prefill (``rlvr_fast.rollouts.parallel``), each response
aggregated by vote or by a generated summary; every path credited by its Shapley value (or
leave-one-out, or alone) under a utility on coalitions of paths, mixed with the outcome reward
(``rlvr_fast.credit.paths``); the loss sums over paths and summaries,
-(1/(paths + summaries)) sum_seq sum_t w_t log pi(y_t). Summaries are graded without the
derivation gate: they condense paths that carry the derivation. A step of several questions
(``questions_per_step``, and so several ranks) samples them in one engine batch, question q from
its own base seed; its Monte-Carlo Shapley orderings then come from a generator of the
question's own, seeded from that base (``credit_generator``), so that a question is credited the
same on any rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from rlvr_fast.credit.judge import GenerativeJudge
from rlvr_fast.credit.paths import ParallelCredit, outcome_utility, parallel_credit
from rlvr_fast.credit.shapley import MajorityVote
from rlvr_fast.engine import EngineCounters, SamplingParams
from rlvr_fast.grading import final_answer, grade_many
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.rollouts.generation import base_seed
from rlvr_fast.rollouts.parallel import ParallelRollout, sample_parallel_batch
from rlvr_fast.train.kinds.parallel_record import (
    ParallelRecord,
    ParallelStats,
    parallel_step_record,
)
from rlvr_fast.train.kinds.base import (
    Question,
    RecordInputs,
    record_arguments,
    recorded_inputs,
    regraded,
    require_token_weighted,
)
from rlvr_fast.train.losses import parallel_grpo_loss
from rlvr_fast.utils.phases import Phases


@dataclass
class PathGrades:
    """A parallel step's grades: the paths' texts, extracted answers and grades, and the
    summaries' (empty under the vote aggregator)."""

    texts: list[str]
    answers: list[str | None]
    correct: list[bool]
    summary_texts: list[str]
    summary_answers: list[str | None]
    summary_correct: list[bool]


@dataclass
class PathStepCredit:
    grades: PathGrades
    credit: ParallelCredit
    path_weights: list[torch.Tensor]
    summary_weights: list[torch.Tensor]


class ParallelKind:
    name: ClassVar[str] = "parallel"
    reference = None  # the study's loss: no KL to a reference model
    entropy_control = None  # nor an entropy bonus

    def __init__(self, config, policy, engine, task, generator: torch.Generator, params: int):
        self.config, self.policy, self.engine = config, policy, engine
        self.generator, self.params = generator, params
        self.sampling = SamplingParams(
            config.max_new_tokens, config.temperature, config.top_p, **config.sampler_options
        )
        self.judge = None
        if config.path_utility == "judge":
            own = config.judge_model == "policy"
            self.judge = GenerativeJudge(
                policy if own else config.judge_model,
                engine=engine if own else None,
                device=policy.device,
            )

    @classmethod
    def check_task(cls, task) -> None:
        if task is not None:
            raise ValueError("parallel-path arms vote on graded answers, so they take no task")

    @classmethod
    def check_config(cls, config) -> None:
        require_token_weighted(config, "parallel")

    def sample(self, questions: list[Question], bases, *, active_steps: int) -> None:
        """Every question's paths (then summaries) in one engine batch; question q from base
        seed ``bases[q]`` (default: one draw of the run's generator per question)."""
        config = self.config
        if bases is None:
            bases = [base_seed(self.generator) for _ in questions]
        rollouts = sample_parallel_batch(
            self.engine,
            [q.prompt_ids for q in questions],
            bases,
            responses=config.group_size,
            paths=config.num_paths,
            params=self.sampling,
            aggregator=config.aggregator,
            encode=self.policy.tokenizer.encode,
        )
        for question, rollout in zip(questions, rollouts):
            question.rollouts = rollout

    def credit(self, questions: list[Question], phase: Phases) -> None:
        for question in questions:
            self.question_credit(question, phase)

    def question_credit(self, question: Question, phase: Phases) -> None:
        rollout: ParallelRollout = question.rollouts
        with phase("reward"):
            grades = self.grades(question.problem.answer, rollout)
        with phase("shapley"):
            credit = self.path_credit(question, grades)
        path_weights, summary_weights = credit.token_weights(
            [len(p) for p in rollout.paths], [len(s) for s in rollout.summaries]
        )
        question.credit = PathStepCredit(grades, credit, path_weights, summary_weights)

    def grades(self, answer: str, rollout: ParallelRollout) -> PathGrades:
        tokenizer = self.policy.tokenizer
        texts = tokenizer.decode_batch(rollout.paths)
        answers, correct = regraded(texts, answer, self.config.gate_min_chars)
        summary_texts = tokenizer.decode_batch(rollout.summaries) if rollout.summaries else []
        summary_answers = [final_answer(t) for t in summary_texts]
        summary_correct = grade_many(summary_answers, [answer] * len(summary_answers))
        return PathGrades(texts, answers, correct, summary_texts, summary_answers, summary_correct)

    def path_credit(self, question: Question, grades: PathGrades) -> ParallelCredit:
        """Each response's utility on its K paths, its outcome reward, and the step's credit."""
        config, k, problem = self.config, self.config.num_paths, question.problem
        rollout: ParallelRollout = question.rollouts
        utilities, r_out = [], []
        for r in range(rollout.responses):
            part = slice(r * k, (r + 1) * k)
            if config.path_utility == "judge":
                game = self.judge.game(problem.question, problem.answer, grades.texts[part])
                utilities.append(game)
            else:
                utilities.append(
                    outcome_utility(config.path_utility, grades.answers[part], grades.correct[part])
                )
            r_out.append(
                float(grades.summary_correct[r])
                if rollout.summaries
                else MajorityVote(grades.answers[part], grades.correct[part]).value((1 << k) - 1)
            )
        return parallel_credit(
            utilities,
            r_out,
            k,
            method=config.path_credit,
            permutations=config.shapley_permutations,
            antithetic=config.shapley_antithetic,
            generator=self.credit_generator(rollout),
            norm=config.path_reward_norm,
            lambda_outcome=config.lambda_outcome,
            lambda_path=config.lambda_path,
            summaries=bool(rollout.summaries),
        )

    def credit_generator(self, rollout: ParallelRollout) -> torch.Generator:
        """What Monte-Carlo Shapley draws its orderings from: the run's generator on a step of
        one question; on a step of several, a generator of the question's own seeded from its
        base (the stream after its paths' and summaries'), which no other question and no rank
        draws from."""
        if self.config.questions_per_step == 1:
            return self.generator
        seed = derive_seed(rollout.base, len(rollout.paths) + rollout.responses)
        return torch.Generator().manual_seed(seed)

    def contributes(self, question: Question) -> bool:
        return not question.credit.credit.homogeneous

    def loss(self, question: Question) -> torch.Tensor:
        step_credit: PathStepCredit = question.credit
        return parallel_grpo_loss(
            self.policy.trained_model,
            question.prompt_ids,
            question.rollouts,
            step_credit.path_weights,
            step_credit.summary_weights,
        )

    def measure(self, questions: list[Question], phase: Phases) -> None:
        """Nothing to measure: the study's loss forms no ratio, KL or entropy."""

    def figures(
        self, questions: list[Question], micro_batches=None, *, over_ranks: bool = False
    ) -> dict[str, float]:
        """No policy figures: the study's loss forms no ratio, KL or entropy."""
        return {}

    def loss_count(self, question: Question) -> int:
        """The sequences ``parallel_grpo_loss`` averages over: paths and summaries."""
        rollout: ParallelRollout = question.rollouts
        return len(rollout.paths) + len(rollout.summaries)

    def step_normaliser(self, questions: list[Question]) -> int:
        """What a pooled step on ``questions`` (of this rank) divides by: their sequences."""
        return sum(self.loss_count(q) for q in questions)

    def stats(self, question: Question) -> ParallelStats:
        config, rollout = self.config, question.rollouts
        credit: ParallelCredit = question.credit.credit
        return ParallelStats(
            paths_per_response=config.num_paths,
            aggregator=config.aggregator,
            path_utility=config.path_utility,
            path_credit=config.path_credit,
            permutations=config.shapley_permutations,
            path_reward_norm=config.path_reward_norm,
            lambda_outcome=config.lambda_outcome,
            lambda_path=config.lambda_path,
            phi=credit.phi,
            phi_se=[float(x) for a in credit.attributions for x in a.se],
            utility_full=[a.full for a in credit.attributions],
            utility_empty=[a.empty for a in credit.attributions],
            r_out=credit.r_out,
            utility_calls=credit.utility_calls,
            summary_prompt_lens=[len(p) for p in rollout.summary_prompts],
            summary_lengths=[len(s) for s in rollout.summaries],
            summary_rewards=credit.summary_returns.tolist(),
        )

    def record(self, question: Question, inputs: RecordInputs) -> ParallelRecord:
        credit: ParallelCredit = question.credit.credit
        return parallel_step_record(
            rewards=credit.path_returns.tolist(),
            sigma_r=credit.sigma,
            homogeneous=credit.homogeneous,
            lengths=[len(p) for p in question.rollouts.paths],
            parallel=self.stats(question),
            **record_arguments(question, inputs, self.config, self.params),
        )

    def rollouts_line(self, step: int, question: Question) -> dict:
        """As on every arm, the line's rewards are the texts' grades; the returns trained on (the
        ledger's rewards) sit in its parallel section, with the paths, votes and credit."""
        config, rollout = self.config, question.rollouts
        grades: PathGrades = question.credit.grades
        credit: ParallelCredit = question.credit.credit
        stats = self.stats(question)
        return {
            "step": step,
            "question_id": question.problem.id,
            "answer": question.problem.answer,
            "prompt_len": len(question.prompt_ids),
            "texts": grades.texts,
            "lengths": [len(p) for p in rollout.paths],
            "rewards": [float(c) for c in grades.correct],
            "parallel": dict(
                question=question.problem.question,
                gold=question.problem.answer,
                paths_per_response=config.num_paths,
                aggregator=config.aggregator,
                path_answers=grades.answers,
                path_correct=[bool(c) for c in grades.correct],
                r_out=credit.r_out,
                phi=credit.phi,
                phi_se=stats.phi_se,
                utility_full=stats.utility_full,
                utility_empty=stats.utility_empty,
                utility_tables=credit.tables,
                summary_texts=grades.summary_texts,
                summary_answers=grades.summary_answers,
                summary_seeds=rollout.summary_seeds,
                path_returns=credit.path_returns.tolist(),
                path_ids=rollout.paths if rollout.summaries else None,
            ),
        }

    def rewards(self, question: Question) -> list[float]:
        return question.credit.credit.path_returns.tolist()

    def texts(self, question: Question) -> list[str]:
        return question.credit.grades.texts

    def executed(self, question: Question) -> EngineCounters:
        return question.rollouts.executed

    @classmethod
    def rederive(
        cls, line: dict, recorded: dict, config, params: int, active_steps: int, *, regrade=True
    ) -> ParallelRecord:
        """The paths' and summaries' grades re-derived from their texts, r_out by the
        aggregator, and, for every deterministic credit (exact Shapley, leave-one-out,
        independent), phi and the path returns recomputed by the trainer's own functions.
        Monte-Carlo phi drew its orderings from the run's generator and the judge scored with
        the run's model, so those come from the ledger; the returns' formula on them is a
        conservation law."""
        from rlvr_fast.train.decision import decide_step

        if not regrade:
            raise ValueError(
                "parallel-path steps vote on graded answers; their rewards are re-graded"
            )
        texts = line["texts"]
        if len(line["lengths"]) != len(texts):
            raise ValueError(
                f"rollouts.jsonl has {len(texts)} texts and {len(line['lengths'])} lengths"
            )
        answers, correct = regraded(texts, line["answer"], config.gate_min_chars)
        details = line["parallel"]
        k = config.num_paths
        summary_texts = details["summary_texts"]
        summary_correct = grade_many(
            [final_answer(text) for text in summary_texts], [line["answer"]] * len(summary_texts)
        )
        groups = [slice(r * k, (r + 1) * k) for r in range(len(answers) // k)]
        r_out = (
            [float(ok) for ok in summary_correct]
            if summary_texts
            else [MajorityVote(answers[g], correct[g]).value((1 << k) - 1) for g in groups]
        )
        stats = ParallelStats(**dict(recorded["parallel"], r_out=r_out))
        rewards, sigma = recorded["rewards"], recorded["sigma_r"]
        homogeneous = recorded["homogeneous"]
        monte_carlo = config.path_credit == "shapley" and config.shapley_permutations > 0
        if not monte_carlo and config.path_utility != "judge":
            credit = parallel_credit(
                [outcome_utility(config.path_utility, answers[g], correct[g]) for g in groups],
                r_out,
                k,
                method=config.path_credit,
                norm=config.path_reward_norm,
                lambda_outcome=config.lambda_outcome,
                lambda_path=config.lambda_path,
                summaries=bool(summary_texts),
            )
            stats = dataclasses.replace(
                stats,
                phi=credit.phi,
                summary_rewards=credit.summary_returns.tolist(),
                utility_full=[a.full for a in credit.attributions],
                utility_empty=[a.empty for a in credit.attributions],
            )
            rewards, sigma, homogeneous = (
                credit.path_returns.tolist(),
                credit.sigma,
                credit.homogeneous,
            )
        decision = decide_step(
            int(not homogeneous),
            skip_zero_var=config.skip_zero_var,
            zero_var_step=config.zero_var_step,
        )
        return parallel_step_record(
            rewards=rewards,
            sigma_r=sigma,
            homogeneous=homogeneous,
            active=decision.active,
            optimizer_step=decision.optimizer_step,
            lengths=line["lengths"],
            parallel=stats,
            **recorded_inputs(line, recorded, config, params),
        )
