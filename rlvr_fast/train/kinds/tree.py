"""Two-stage K x B trees with TreeRL credit (seed §4.2-4.3): flat groups until
``bifurcate_after_active`` steps ran a backward pass (the warmup, ledgered "flat_warmup"), then
per question a tree sampled by ``rlvr_fast.rollouts.trees`` (Stage-1 roots forked from one
prompt prefill, Stage 2 forked on the paged KV cache), its leaves credited by
``rlvr_fast.credit.tree`` (prefix and continuation weights, centred with ``zero_cont_mass``)."""

from __future__ import annotations

from typing import ClassVar

from rlvr_fast.credit.tree import tree_credit
from rlvr_fast.rollouts.pairs import PairCategory, TreePair
from rlvr_fast.rollouts.trees import sample_trees_ids
from rlvr_fast.train.kinds.base import Question, RecordInputs, require_token_weighted
from rlvr_fast.train.kinds.flat import FlatKind, QuestionCredit, Rollouts
from rlvr_fast.train.kinds.flat_record import FlatRecord
from rlvr_fast.train.kinds.tree_record import TreeRecord, tree_step_record


class TreeKind(FlatKind):
    name: ClassVar[str] = "tree"
    category: ClassVar[PairCategory] = PairCategory.FLAT_WARMUP

    @classmethod
    def check_config(cls, config) -> None:
        require_token_weighted(config, "tree")
        if config.group_size != config.tree_k * config.tree_b:
            raise ValueError(
                f"tree arms need group_size = tree_k * tree_b ({config.tree_k * config.tree_b}) "
                f"so flat warmup and tree steps train on as many leaves, got {config.group_size}"
            )
        if not 1 <= config.t_min <= config.t_max < config.max_new_tokens:
            raise ValueError(
                f"need 1 <= t_min <= t_max < max_new_tokens, got {config.t_min}, "
                f"{config.t_max}, {config.max_new_tokens}"
            )

    @staticmethod
    def trees_due(config, active_steps: int) -> bool:
        """Trees once ``bifurcate_after_active`` steps ran a backward pass."""
        return active_steps >= config.bifurcate_after_active

    def sample(self, questions: list[Question], bases, *, active_steps: int) -> None:
        if not self.trees_due(self.config, active_steps):
            super().sample(questions, bases, active_steps=active_steps)
            return
        config = self.config
        trees = sample_trees_ids(
            self.engine,
            [q.prompt_ids for q in questions],
            newline_token_ids=self.policy.tokenizer.newline_token_ids,
            k=config.tree_k,
            b=config.tree_b,
            t_min=config.t_min,
            t_max=config.t_max,
            max_new_tokens=config.max_new_tokens,
            early_eos_mode=config.early_eos_mode,
            temperature=config.temperature,
            top_p=config.top_p,
            sampler_options=config.sampler_options,
            generator=self.generator,
            bases=bases,
            reprefill=config.tree_reprefill,
        )
        for question, tree in zip(questions, trees):
            question.rollouts = Rollouts(tree.leaves, tree.executed, tree)

    def question_credit(
        self, question: Question, texts: list[str], rewards: list[float], step_std=None
    ) -> QuestionCredit:
        tree = question.rollouts.tree
        if tree is None:
            return super().question_credit(question, texts, rewards, step_std)
        config = self.config
        lengths = [len(c) for c in question.rollouts.completions]
        credit = tree_credit(
            [rewards[2 * k : 2 * k + 2] for k in range(len(tree.pairs))],
            tree.prefix_lens,
            beta=config.beta,
            alpha=config.alpha,
            clamped_prefix=config.clamped_prefix,
        )
        leaf_lengths = [p.lengths for p in tree.pairs]
        if config.zero_cont_mass:
            credit = credit.zero_continuation_mass(leaf_lengths)
        return QuestionCredit(
            texts, rewards, lengths, credit.sigma, None, credit.token_weights(leaf_lengths)
        )

    def record(self, question: Question, inputs: RecordInputs) -> FlatRecord | TreeRecord:
        tree = question.rollouts.tree
        if tree is None:
            return super().record(question, inputs)
        return tree_step_record(
            pairs=tree.pairs,
            stage2_gen=tree.stage2_generated,
            **self.common_record(question, inputs),
        )

    def rollouts_line(self, step: int, question: Question) -> dict:
        """On tree steps also what the sampler reported per pair (|p^(k)| is not in the texts:
        Stage 1's discarded tail is)."""
        line = super().rollouts_line(step, question)
        tree = question.rollouts.tree
        if tree is not None:
            line.update(
                prefix_lens=tree.prefix_lens,
                categories=[p.category for p in tree.pairs],
                stage1_lengths=[p.stage1_len for p in tree.pairs],
                stage2_gen=tree.stage2_generated,
            )
        return line

    @classmethod
    def rederive(
        cls, line: dict, recorded: dict, config, params: int, active_steps: int, *, regrade=True
    ) -> FlatRecord | TreeRecord:
        """As a flat step during the warmup; on tree steps the pairs rebuilt from the rollouts
        line's categories, prefix and Stage-1 lengths."""
        tree_step = cls.trees_due(config, active_steps)
        if tree_step != ("categories" in line):
            raise ValueError(
                f"config.json makes this a {'tree' if tree_step else 'flat'} step, "
                f"rollouts.jsonl records a {'flat' if tree_step else 'tree'} one"
            )
        if not tree_step:
            return super().rederive(line, recorded, config, params, active_steps, regrade=regrade)
        inputs = cls.rederive_inputs(line, recorded, config, params, regrade)
        lengths = line["lengths"]
        # The ledger reads only the lengths of a pair's token lists, and rollouts.jsonl keeps the
        # lengths, not the tokens: the lists below stand in with zeros of those lengths.
        pairs = [
            TreePair(
                PairCategory(category),
                prefix_len,
                root_tokens=[0] * root,
                leaves=[[0] * lengths[2 * k], [0] * lengths[2 * k + 1]],
                finish_reasons=[],
            )
            for k, (category, prefix_len, root) in enumerate(
                zip(line["categories"], line["prefix_lens"], line["stage1_lengths"], strict=True)
            )
        ]
        return tree_step_record(pairs=pairs, stage2_gen=line["stage2_gen"], **inputs)
