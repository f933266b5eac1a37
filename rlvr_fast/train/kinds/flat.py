"""Flat GRPO groups (seed §1): G rollouts of each question, its prompt prefilled once and forked
G times; A_i = (R_i - mean R) / (std R + 1e-4) on every token of rollout i; the loss in the
arm's ``loss_order`` (the study's sum type), or TRL's loss of ``loss_type`` through the fused
policy loss, held as a component (``rlvr_fast.train.policy_loss_term.TRLPolicyLoss``: clipping,
the KL to a reference model, the entropy, its bonus and token mask, the off-policy sequence
mask); a ledger line of G leaves in pairs
(2i, 2i + 1) with prefix 0."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rlvr_fast.credit.group import group_stats, scored_std, standardised_advantages
from rlvr_fast.engine import EngineCounters, SamplingParams
from rlvr_fast.rollouts.generation import sample_groups
from rlvr_fast.rollouts.pairs import PairCategory
from rlvr_fast.rollouts.turns import sample_turns
from rlvr_fast.rollouts.trees import TreeRollout
from rlvr_fast.train import distributed
from rlvr_fast.train.kinds.flat_record import FlatRecord, flat_step_record
from rlvr_fast.train.kinds.base import (
    Question,
    RecordInputs,
    record_arguments,
    recorded_inputs,
    recorded_rewards,
    regraded,
)
from rlvr_fast.ops.loss_types import loss_type
from rlvr_fast.train.losses import scored_lengths, sequence_scales, study_loss
from rlvr_fast.train.policy import PolicyTerms
from rlvr_fast.train.policy_loss_term import TRLPolicyLoss
from rlvr_fast.utils.phases import Phases


@dataclass
class Rollouts:
    """One question's completions (leaf order), the work the engine executed for them (for
    questions sampled in one batch, the batch's) and, for a tree step, the tree they came
    from."""

    completions: list[list[int]]
    executed: EngineCounters
    tree: TreeRollout | None = None
    # Per completion, 1 on the tokens the loss scores, 0 on appended ones (a conversation's
    # tool results); None: every token scored.
    masks: list[list[int]] | None = None


@dataclass
class QuestionCredit:
    """One question's graded rollouts and credit: texts, rewards, lengths, sigma_R, the
    per-rollout advantages (flat steps; the sum_then_scale loss reads them) and the per-token
    weights of every completion."""

    texts: list[str]
    rewards: list[float]
    lengths: list[int]
    sigma: float
    advantages: torch.Tensor | None
    token_weights: list[torch.Tensor]
    policy: PolicyTerms | None = None
    share_policy: PolicyTerms | None = None  # the terms of the step's share, when it has one


class FlatKind:
    name: ClassVar[str] = "flat"
    category: ClassVar[PairCategory] = PairCategory.FLAT

    def __init__(self, config, policy, engine, task, generator: torch.Generator, params: int):
        self.config, self.policy, self.engine = config, policy, engine
        self.task, self.generator, self.params = task, generator, params
        self.sampling = SamplingParams(
            config.max_new_tokens, config.temperature, config.top_p, **config.sampler_options
        )
        # The loss type's record in the run's loss order (rlvr_fast.ops.loss_types).
        self.loss_type = loss_type(config.loss_type, order=config.loss_order)
        self.normaliser = self.loss_type.normaliser
        # TRL's loss types: the policy-loss component (its reference model and entropy control
        # are the kind's, for the trainer to step and checkpoint); None: the study's sum.
        self.policy_loss = TRLPolicyLoss(config, policy) if config.loss.fused else None
        self.reference = self.policy_loss.reference if self.policy_loss else None
        self.entropy_control = self.policy_loss.entropy_control if self.policy_loss else None

    @classmethod
    def check_config(cls, config) -> None:
        """Flat arms have no settings across fields beyond the common ones."""

    @classmethod
    def check_task(cls, task) -> None:
        """Any task: its prompts and rewards (``rlvr_fast.train.task.MathTask`` by default)."""

    def sample(self, questions: list[Question], bases, *, active_steps: int) -> None:
        """Every question's G rollouts in one engine batch; question q from base seed
        ``bases[q]`` (default: one draw of the run's generator per question). A task with
        ``turns`` (tool calling) makes each rollout a conversation (``sample_conversations``)."""
        group = self.config.group_size
        if getattr(self.task, "turns", None) is not None:
            self.sample_conversations(questions, bases)
            return
        out = sample_groups(
            self.engine,
            [q.prompt_ids for q in questions],
            group,
            self.sampling,
            generator=self.generator,
            bases=bases,
        )
        for index, question in enumerate(questions):
            tokens = out.tokens[index * group : (index + 1) * group]
            question.rollouts = Rollouts(tokens, out.counters)

    def sample_conversations(self, questions: list[Question], bases) -> None:
        """Every question's G rollouts as conversations (``rollouts.turns.sample_turns``): the
        task's ``turns`` says what each row's turn is followed by (a tool's result, appended to
        the live sequence and masked out of the loss) and keeps the conversations."""
        turns, group = self.task.turns, self.config.group_size
        prompts = [q.prompt_ids for q in questions]
        out = sample_turns(
            self.engine,
            prompts,
            group,
            self.sampling,
            turns.begin(prompts, group),
            max_rounds=turns.max_rounds,
            max_completion_tokens=self.config.max_new_tokens,
            generator=self.generator,
            bases=bases,
        )
        turns.end(out)
        for index, question in enumerate(questions):
            part = slice(index * group, (index + 1) * group)
            question.rollouts = Rollouts(out.tokens[part], out.counters, masks=out.masks[part])

    def credit(self, questions: list[Question], phase: Phases) -> None:
        """Every question's rewards from one call of the task (the whole step's rollouts), then
        its credit; with ``advantage_std`` batch every group is scaled by the std of all the
        step's rewards, over every rank."""
        with phase("reward"):
            texts = [self.policy.tokenizer.decode_batch(q.rollouts.completions) for q in questions]
            rewards = self.task.rewards(
                [q.problem for q in questions], texts, [q.rollouts.completions for q in questions]
            )
            step_std = None
            if self.config.advantage_std == "batch":
                step_std = scored_std(
                    [r for rank in distributed.all_gather(rewards) for q in rank for r in q]
                )
            for question, question_texts, question_rewards in zip(questions, texts, rewards):
                question.credit = self.question_credit(
                    question, question_texts, question_rewards, step_std
                )
        if self.reference is not None:
            with phase("reference"):
                for question in questions:
                    self.add_reference_logprobs(question)
        if self.config.updates_per_generation > 1:
            with phase("old_logprobs"):
                for question in filter(self.contributes, questions):
                    self.add_old_logprobs(question)

    def question_credit(
        self, question: Question, texts: list[str], rewards: list[float], step_std=None
    ) -> QuestionCredit:
        """The standardised advantage on every token of the group (scaled by ``step_std``, the
        step's std, when given), scaled per sequence as ``loss_type`` says."""
        config = self.config
        lengths = [len(c) for c in question.rollouts.completions]
        advantages, sigma = standardised_advantages(
            rewards, scale=config.scale_rewards, scale_std=step_std
        )
        masked = self.truncated(question) if config.mask_truncated else None
        if self.policy_loss:
            cut = masked or [False] * len(lengths)
            scored = scored_lengths(question.rollouts.completions, question.rollouts.masks)
            kept = [0 if m else n for n, m in zip(scored, cut)]
            terms = PolicyTerms(advantages, kept)
            return QuestionCredit(texts, rewards, lengths, sigma, advantages, [], terms)
        scales = sequence_scales(lengths, masked)
        weights = [(a * s).expand(n) for a, s, n in zip(advantages, scales, lengths)]
        return QuestionCredit(texts, rewards, lengths, sigma, advantages, weights)

    def loss_completions(self, question: Question) -> list[list[int]]:
        """The completions TRL's loss reads: those masked out of it (mask_truncated) empty."""
        kept = question.credit.policy.lengths
        return [c if n else [] for c, n in zip(question.rollouts.completions, kept)]

    def loss_masks(self, question: Question) -> list[list[int]] | None:
        """The masks of ``loss_completions`` (None: every token scored)."""
        masks = question.rollouts.masks
        if masks is None:
            return None
        return [m if n else [] for m, n in zip(masks, question.credit.policy.lengths)]

    def add_old_logprobs(self, question: Question) -> None:
        """The policy's log-probabilities of the loss tokens before the generation's first
        update, by the loss's own fused pass without gradients (TRL's old_per_token_logps):
        the engine's at sampling time would be those of its bf16 decode copy, through other
        kernels and the sampler's top-p, so the first update's ratio would not be exactly 1."""
        question.credit.policy.old_logprobs = self.policy_loss.logprobs(
            self.policy.model,
            question.prompt_ids,
            self.loss_completions(question),
            self.loss_masks(question),
        )

    def add_reference_logprobs(self, question: Question) -> None:
        """The reference model's log-probabilities of the question's loss tokens, once per
        generation (TRL's ref_per_token_logps)."""
        question.credit.policy.ref_logprobs = self.policy_loss.logprobs(
            self.reference.model,
            question.prompt_ids,
            self.loss_completions(question),
            self.loss_masks(question),
        )

    def truncated(self, question: Question) -> list[bool]:
        """Which completions were cut at the cap (they end on no end-of-sequence token)."""
        eos = self.policy.tokenizer.eos_token_ids
        return [c[-1] not in eos for c in question.rollouts.completions]

    def loss_count(self, question: Question, whole: bool = False) -> int:
        """What the question's loss is an average over, which a pooled multi-question step
        re-normalises over the whole step (``rlvr_fast.train.steps.pooled_weights``): its tokens
        when the loss type's normaliser counts tokens (dapo's; those of truncated completions
        left out with ``mask_truncated``), else its completions; those of its ``share`` of the
        step, unless ``whole``."""
        completions = question.rollouts.completions
        picked = range(len(completions))
        if question.share is not None and not whole:
            picked = question.share
        if not self.normaliser.counts_tokens:
            return len(picked)
        cut = self.truncated(question) if self.config.mask_truncated else [False] * len(completions)
        scored = scored_lengths(completions, question.rollouts.masks)
        return sum(scored[i] for i in picked if not cut[i])

    def step_normaliser(self, questions: list[Question]) -> float:
        """The sum a pooled step on ``questions`` normalises by (of this rank): their loss
        counts; on shares of their generation, under a normaliser over the generation's tokens
        (dapo's) the generation's tokens over generation_steps."""
        if questions[0].share is not None and self.normaliser.over_generation:
            tokens = sum(self.loss_count(q, whole=True) for q in questions)
            return tokens / self.config.generation_steps
        return sum(self.loss_count(q) for q in questions)

    def contributes(self, question: Question) -> bool:
        """Its rewards vary, or a KL term or an entropy bonus pulls it; and the step trains on
        one of its completions."""
        pulled = question.credit.sigma != 0 or self.config.pulls_every_group
        return pulled and question.share != []

    def loss(self, question: Question) -> torch.Tensor:
        if self.policy_loss:
            terms, completions, masks = self.step_terms(question)
            return self.policy_loss.loss(question.prompt_ids, completions, terms, masks)
        config, credit = self.config, question.credit
        return study_loss(
            self.policy.trained_model,
            question.prompt_ids,
            question.rollouts.completions,
            self.loss_type,
            credit.advantages,
            credit.token_weights,
            config.temperature if config.tempered_logprobs else 1.0,
        )

    def step_terms(self, question: Question):
        """The policy terms, loss completions and their masks of the question this step: its
        share's (kept as ``credit.share_policy``) when the step trains on a share of the
        generation."""
        terms, completions = question.credit.policy, self.loss_completions(question)
        masks = self.loss_masks(question)
        if question.share is not None:
            terms = question.credit.share_policy = terms.subset(question.share)
            completions = [completions[i] for i in question.share]
            masks = None if masks is None else [masks[i] for i in question.share]
        return terms, completions, masks

    def measure(self, questions: list[Question], phase: Phases) -> None:
        """On TRL's loss types, the figures of ``questions``, whose loss does not run this step
        (TRL's loss runs on every completion and logs their entropy): a pass of the fused op
        without gradients, at the weights the step's losses see, in their training mode. The
        study's sum type logs no entropy and runs nothing here."""
        if not self.policy_loss or not questions:
            return
        self.policy.model.train()
        with phase("measure"):
            for question in questions:
                terms, completions, masks = self.step_terms(question)
                self.policy_loss.measure(question.prompt_ids, completions, terms, masks)

    def figures(
        self,
        questions: list[Question],
        micro_batches: list[list[int]] | None = None,
        *,
        over_ranks: bool = False,
    ) -> dict[str, float]:
        """TRL's policy figures of the step (``rlvr_fast.train.policy.step_figures``, over
        ``micro_batches`` of its completions; ``over_ranks``: of every rank's questions, a
        collective), {} on the study's sum type."""
        if not self.policy_loss:
            return {}
        terms = [q.credit.policy for q in questions]
        if questions[0].share is not None:  # this step's shares of the generation
            terms = [q.credit.share_policy for q in questions]
        return self.policy_loss.figures(terms, micro_batches, over_ranks=over_ranks)

    def record(self, question: Question, inputs: RecordInputs) -> FlatRecord:
        return flat_step_record(
            lengths=question.credit.lengths,
            category=self.category,
            reused=inputs.iteration > 0,
            trained=question.share,
            **self.common_record(question, inputs),
        )

    def common_record(self, question: Question, inputs: RecordInputs) -> dict:
        """The record arguments every question-level ledger record takes."""
        return dict(
            rewards=question.credit.rewards,
            sigma_r=question.credit.sigma,
            **record_arguments(question, inputs, self.config, self.params),
        )

    def rollouts_line(self, step: int, question: Question) -> dict:
        """What ``verify`` re-derives a question's ledger record from: the answer to re-grade
        the texts against, the prompt length, the lengths and the texts' grades."""
        credit = question.credit
        return {
            "step": step,
            "question_id": question.problem.id,
            "answer": question.problem.answer,
            "prompt_len": len(question.prompt_ids),
            "texts": credit.texts,
            "lengths": credit.lengths,
            "rewards": credit.rewards,
        }

    def rewards(self, question: Question) -> list[float]:
        return question.credit.rewards

    def texts(self, question: Question) -> list[str]:
        return question.credit.texts

    def executed(self, question: Question) -> EngineCounters:
        return question.rollouts.executed

    @classmethod
    def rederive(
        cls, line: dict, recorded: dict, config, params: int, active_steps: int, *, regrade=True
    ) -> FlatRecord:
        """The ledger record ``line`` (a rollouts line) should have: rewards re-graded from its
        texts (or, ``regrade=False``, the recorded ones), sigma_R, the stepping rule, the token
        counts; engine counts, timings, loss and gradient norm copied from ``recorded`` (nothing
        on disk determines them)."""
        inputs = cls.rederive_inputs(line, recorded, config, params, regrade)
        if "categories" in line:
            raise ValueError(
                "config.json makes this a flat step, rollouts.jsonl records a tree one"
            )
        return flat_step_record(
            lengths=line["lengths"],
            category=cls.category,
            reused=line.get("iteration", 0) > 0,
            trained=line.get("trained"),
            **inputs,
        )

    @classmethod
    def rederive_inputs(
        cls, line: dict, recorded: dict, config, params: int, regrade: bool = True
    ) -> dict:
        from rlvr_fast.train.decision import decide_step

        texts, lengths = line["texts"], line["lengths"]
        if len(lengths) != len(texts):
            raise ValueError(f"rollouts.jsonl has {len(texts)} texts and {len(lengths)} lengths")
        if regrade:
            _, correct = regraded(texts, line["answer"], config.gate_min_chars)
            rewards = [float(ok) for ok in correct]
            sigma = float(group_stats(torch.tensor(rewards, dtype=torch.float32))[1])
        else:
            rewards = recorded_rewards(recorded, len(texts))
            unscored = [math.nan if r is None else r for r in rewards]
            sigma = standardised_advantages(unscored, scale=config.scale_rewards)[1]
        decision = decide_step(
            int((sigma != 0 or config.pulls_every_group) and line.get("trained") != []),
            skip_zero_var=config.skip_zero_var,
            zero_var_step=config.zero_var_step,
        )
        return dict(
            recorded_inputs(line, recorded, config, params),
            rewards=rewards,
            sigma_r=sigma,
            active=decision.active,
            optimizer_step=decision.optimizer_step,
        )
