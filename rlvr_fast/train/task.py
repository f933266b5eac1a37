"""The study's task: a question in the study's prompt template; reward 1 when the last boxed
answer grades correct against the problem's answer (with the derivation gate: and starts at or
after ``gate_min_chars`` characters). A trainer asks its task for a step's prompt ids and
rewards; ``rlvr_fast.trl_compat`` supplies TRL's reward functions instead."""

from __future__ import annotations

from rlvr_fast.data.problems import Problem, render_prompt
from rlvr_fast.grading import final_answer, grade_many


class MathTask:
    def __init__(self, tokenizer, gate_min_chars: int | None) -> None:
        self.tokenizer, self.gate_min_chars = tokenizer, gate_min_chars

    def prompt_ids(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode(render_prompt(problem.question))

    def rewards(
        self, problem: Problem, texts: list[str], completions: list[list[int]]
    ) -> list[float]:
        answers = [final_answer(t, min_chars=self.gate_min_chars) for t in texts]
        return [float(ok) for ok in grade_many(answers, [problem.answer] * len(answers))]
