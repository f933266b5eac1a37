"""Evaluation (greedy by default): per-item grades with the extracted answer, accuracy and cap hits.

Each item records what the study's per-item grade files record: item id, extracted answer,
whether it is correct, the response length in tokens, whether it hit the token cap, and whether it
passes the 30-character derivation gate (the short-guess / derivation split of the study's §3.1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from rlvr_fast.data.problems import Problem, render_prompt
from rlvr_fast.engine import FINISH_CAP, RolloutEngine, SamplingParams
from rlvr_fast.rollouts.generation import generate
from rlvr_fast.grading import extract_boxed, grade_many, passes_gate


@dataclass
class ItemGrade:
    id: str
    answer: str
    extracted: str | None
    correct: bool
    length: int
    cap_hit: bool
    derivation: bool
    level: int | None
    response: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class EvalResult:
    items: list[ItemGrade]

    @property
    def accuracy(self) -> float:
        return sum(i.correct for i in self.items) / len(self.items)

    @property
    def cap_hits(self) -> int:
        return sum(i.cap_hit for i in self.items)

    def summary(self) -> dict:
        guesses = [i for i in self.items if not i.derivation]
        derivations = [i for i in self.items if i.derivation]
        levels = sorted({i.level for i in self.items if i.level is not None})
        return {
            "items": len(self.items),
            "correct": sum(i.correct for i in self.items),
            "accuracy": self.accuracy,
            "cap_hits": self.cap_hits,
            "truncated_incorrect": sum(i.cap_hit and not i.correct for i in self.items),
            "short_guess_fraction": len(guesses) / len(self.items),
            "short_guess_accuracy": _mean(i.correct for i in guesses),
            "derivation_accuracy": _mean(i.correct for i in derivations),
            "accuracy_by_level": {
                level: _mean(i.correct for i in self.items if i.level == level) for level in levels
            },
        }


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def encode_prompts(policy, problems: Sequence[Problem], max_new_tokens: int) -> list[list[int]]:
    """Every problem's prompt token ids, checked by ``check_prompt_lengths``."""
    prompts = policy.tokenizer.encode_batch([render_prompt(p.question) for p in problems])
    check_prompt_lengths(policy, problems, prompts, max_new_tokens)
    return prompts


def check_prompt_lengths(
    policy, problems: Sequence[Problem], prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> None:
    """Each prompt leaves room for ``max_new_tokens`` in the model's positions: a longer
    sequence decodes past what the model was trained on (and a huge question would take minutes
    and gigabytes before failing anywhere else). The error names the problem and its file."""
    context = policy.config.max_position_embeddings
    for problem, ids in zip(problems, prompts):
        if len(ids) + max_new_tokens > context:
            raise ValueError(
                f"{problem.source}: problem {problem.id!r} has a prompt of "
                f"{len(ids):,} tokens; with max_new_tokens {max_new_tokens:,} it "
                f"exceeds the model's {context:,} positions"
            )


def evaluate(
    policy,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int = 2048,
    progress: bool = True,
    desc: str = "eval",
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    engine: RolloutEngine | None = None,
) -> EvalResult:
    """Decode every problem's prompt once and grade the last boxed answer.

    Greedy at ``max_new_tokens`` unless ``params`` (with ``generator``) asks for sampling. The
    whole set goes to the rollout engine (``engine``, default the policy's own) at once:
    continuously batched, a finished item's place taken by the next waiting one.
    """
    if not problems:
        raise ValueError("evaluate: no problems")
    params = params or SamplingParams.greedy(max_new_tokens)
    prompts = encode_prompts(policy, problems, params.max_new_tokens)
    with tqdm(total=len(problems), desc=desc, unit="item", disable=not progress) as bar:
        out = generate(
            engine or RolloutEngine.shared(policy),
            prompts,
            params,
            generator=generator,
            on_finish=lambda _: bar.update(1),
        )
    texts = policy.tokenizer.decode_batch(out.tokens)
    extracted_answers = [extract_boxed(text) for text in texts]
    grades = grade_many(extracted_answers, [p.answer for p in problems])
    items = []
    for problem, text, extracted, correct, length, reason in zip(
        problems, texts, extracted_answers, grades, out.lengths, out.finish_reasons
    ):
        items.append(
            ItemGrade(
                id=problem.id,
                answer=problem.answer,
                extracted=extracted,
                correct=correct,
                length=length,
                cap_hit=reason == FINISH_CAP,
                derivation=passes_gate(text),
                level=problem.level,
                response=text,
            )
        )
    return EvalResult(items)
