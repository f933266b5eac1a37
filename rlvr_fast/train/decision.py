"""The stepping rule of every arm, in one function that the trainer and ``verify`` share.

A question *contributes* when its rewards vary (a tree's or a group's sigma_R > 0; on
parallel-path steps, when some path has a nonzero advantage). A step runs a backward pass
(is *active*) when a question contributes, or always when the arm does not skip homogeneous
groups (``skip_zero_var`` off: the seed's baseline backpropagates zero advantages too). An
inactive step takes a zero-gradient AdamW step (``zero_var_step="zero_grad"``) or none
("skip"). On multi-question steps (which need ``skip_zero_var``) the contributing questions are
counted over every question of the step, on every rank, and each contributing one adds its unit
gradient; a question whose rewards agree adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO_VAR_STEPS = ("zero_grad", "skip")


@dataclass(frozen=True)
class StepDecision:
    active: bool  # a backward pass runs and AdamW steps on its gradient
    optimizer_step: bool  # AdamW steps (on the gradient, or with zero gradients)
    contributing: int  # questions whose gradient enters the step

    def question_active(self, contributes: bool, skip_zero_var: bool) -> bool:
        """Whether one question of the step runs its backward pass."""
        return self.active and (contributes or not skip_zero_var)


def decide_step(contributing: int, *, skip_zero_var: bool, zero_var_step: str) -> StepDecision:
    """The step's decision from the number of its questions (over all ranks) that contribute."""
    if zero_var_step not in ZERO_VAR_STEPS:
        raise ValueError(f"zero_var_step must be one of {', '.join(ZERO_VAR_STEPS)}")
    active = contributing > 0 or not skip_zero_var
    return StepDecision(active, active or zero_var_step == "zero_grad", contributing)
