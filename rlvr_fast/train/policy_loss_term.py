"""TRL's policy loss as a component a step kind holds (``FlatKind`` holds one on TRL's loss
types; any kind whose questions are groups of completions could): the run's
``PolicyLossSettings``, the reference model of ``kl_beta`` > 0, TRL's adaptive entropy control,
and the passes of the fused op on one question's group: the reference and old
log-probabilities, the loss (at the coefficient the entropy control applies, which then takes the
step's entropy), the figures of a group whose loss does not run, and the step's figures
(``rlvr_fast.train.policy.step_figures`` with the entropy bonus's). The kind keeps what is
question-level: which completions and which share of the generation a loss reads."""

from __future__ import annotations

import dataclasses

import torch

from rlvr_fast.train import distributed
from rlvr_fast.train.losses import completion_logprobs, completion_stats, policy_loss
from rlvr_fast.train.policy import (
    EntropyControl,
    PolicyTerms,
    ReferenceModel,
    policy_settings,
    policy_term_entropy,
    step_figures,
)


class TRLPolicyLoss:
    """The component (module docstring) of a run with ``config`` training ``policy``."""

    def __init__(self, config, policy) -> None:
        self.config, self.policy = config, policy
        self.settings = policy_settings(config)
        # TRL scores log softmax(logits / temperature).
        self.temperature = config.temperature if config.tempered_logprobs else 1.0
        self.reference = None
        if config.kl_beta > 0:
            sync = config.ref_model_sync_steps if config.sync_ref_model else None
            self.reference = ReferenceModel(
                policy.model, sync, config.ref_model_mixup_alpha, policy.adapters
            )
        self.entropy_control = EntropyControl(config) if config.use_adaptive_entropy else None

    def logprobs(self, model, prompt_ids: list[int], completions: list[list[int]], masks=None):
        """``model``'s log-probabilities [N] of the scored tokens of ``completions`` (``masks``:
        ``rlvr_fast.train.losses.policy_loss``'s), no gradients."""
        return completion_logprobs(model, prompt_ids, completions, self.temperature, masks)

    def loss(
        self,
        prompt_ids: list[int],
        completions: list[list[int]],
        terms: PolicyTerms,
        masks: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """TRL's loss of one group (one micro-batch), at the coefficient the adaptive entropy
        control applies this step, which then takes the step's entropy; ``terms.stats`` keeps
        the pass's figures."""
        settings = self.settings
        if self.entropy_control is not None:
            settings = dataclasses.replace(settings, entropy_coef=self.entropy_control.applied())
        loss, terms.stats = policy_loss(
            self.policy.trained_model,
            prompt_ids,
            completions,
            terms.advantages,
            settings,
            old_logprobs=terms.old_logprobs,
            ref_logprobs=terms.ref_logprobs,
            temperature=self.temperature,
            masks=masks,
        )
        if self.config.entropy_bonus:
            entropy = policy_term_entropy(terms.stats.entropy, terms.lengths, settings)
            # TRL's policy_loss metric: the loss before the bonus (one micro-batch, no
            # accumulation). Its controller moves in training only, not at an evaluation.
            terms.policy_loss = float(loss.detach()) + settings.entropy_coef * entropy
            if self.entropy_control is not None and self.policy.trained_model.training:
                self.entropy_control.after_step(entropy)
        return loss

    def measure(
        self,
        prompt_ids: list[int],
        completions: list[list[int]],
        terms: PolicyTerms,
        masks: list[list[int]] | None = None,
    ) -> None:
        """The figures of a group whose loss does not run this step (``terms.stats``): a pass
        of the fused op without gradients."""
        terms.stats = completion_stats(
            self.policy.model, prompt_ids, completions, self.temperature, masks
        )

    def figures(
        self,
        terms: list[PolicyTerms],
        micro_batches: list[list[int]] | None = None,
        *,
        over_ranks: bool = False,
    ) -> dict[str, float]:
        """TRL's policy figures of a step's groups (``step_figures``; ``over_ranks``: every
        rank's, a collective), with the entropy bonus's loss and coefficient (after the step's
        update, as TRL logs it)."""
        figures = step_figures(terms, self.settings, micro_batches, over_ranks=over_ranks)
        if self.config.entropy_bonus:
            losses = [t.policy_loss for t in terms if t.policy_loss is not None]
            if over_ranks:
                losses = [loss for part in distributed.all_gather(losses) for loss in part]
            if losses:
                figures["policy_loss"] = sum(losses) / len(losses)
            control = self.entropy_control
            figures["entropy_coef"] = self.config.entropy_coef if control is None else control.coef
            if control is not None:  # what moved it (verify re-derives the coefficients)
                figures["policy_term_entropy"] = control.last_entropy
        return figures
