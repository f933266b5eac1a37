"""The study's task: a question in the study's prompt template; reward 1 when the last boxed
answer grades correct against the problem's answer (with the derivation gate: and starts at or
after ``gate_min_chars`` characters). A trainer asks its task for each question's prompt ids
and, once per step, for the rewards of all the step's questions (a task scoring in batches, as
TRL's reward functions and reward models do, sees the whole step); ``rlvr_fast.trl_compat``
supplies TRL's reward functions instead."""

from __future__ import annotations

from rlvr_fast.data.problems import Problem, render_prompt
from rlvr_fast.grading import final_answer, grade_many


class MathTask:
    def __init__(self, tokenizer, gate_min_chars: int | None) -> None:
        self.tokenizer, self.gate_min_chars = tokenizer, gate_min_chars

    def prompt_ids(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode(render_prompt(problem.question))

    def rewards(
        self, problems: list[Problem], texts: list[list[str]], completions: list[list[list[int]]]
    ) -> list[list[float]]:
        """Each question's rewards: ``texts[q]`` and ``completions[q]`` are problem q's rollouts."""
        return [self.question_rewards(p, t) for p, t in zip(problems, texts, strict=True)]

    def question_rewards(self, problem: Problem, texts: list[str]) -> list[float]:
        answers = [final_answer(t, min_chars=self.gate_min_chars) for t in texts]
        return [float(ok) for ok in grade_many(answers, [problem.answer] * len(answers))]
