"""The trainer's task for a TRL script: prompts from the dataset's ``prompt`` column and rewards
from TRL-style reward functions, called once per step over all its completions, as TRL calls
them over a generation batch:

    reward_func(prompts=[...], completions=[...], completion_ids=[[...]], <every other dataset
                column but "completion" and "completion_ids", one value per completion>,
                trainer_state=state, log_extra=..., log_metric=...)

(prompt q repeated G times, the groups in the step's order). Prompts and completions are strings
for plain-text prompts and message lists for conversational ones (a completion is then
``[{"role": "assistant", "content": text}]``). A function, or an ``async def`` coroutine
function (several are awaited together), returns one float, or None, per completion; a reward
model (a path, or a loaded sequence-classification model) scores prompt + completion in one
batch, as TRL does. Rewards are weighted by ``reward_weights`` and summed with None read as
missing (a completion every function leaves unscored gets NaN, and no advantage); with
``normalize_each`` (TRL's multi_objective_aggregation="normalize_then_sum") each function's
rewards are first standardised within their group, (r - mean) / (std + 1e-4).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvr_fast.data.problems import Problem
from rlvr_fast.grading import passes_gate


def is_conversational(prompt) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


def callable_name(func) -> str:
    """A reward function's name in logged keys (rewards/NAME/mean): partials by the wrapped
    function, callable objects by their class, reward models by their checkpoint's name."""
    while isinstance(func, functools.partial):
        func = func.func
    if isinstance(func, RewardModel):
        return func.name
    return getattr(func, "__name__", type(func).__name__)


class RewardModel:
    """A sequence-classification model as a reward function: logit 0 of prompt + completion
    (a conversation through its tokenizer's chat template), right-padded in one batch."""

    def __init__(self, model, processing_class, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, (str, Path)):
            source = str(model)
            model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
        else:
            source = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(source)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        model.config.pad_token_id = processing_class.pad_token_id
        self.model = model.to(device).eval()
        self.tokenizer, self.device = processing_class, device
        self.name = source.rstrip("/").split("/")[-1]

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        if is_conversational(prompts[0]):
            texts = [
                self.tokenizer.apply_chat_template(p + c, tokenize=False)
                for p, c in zip(prompts, completions)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(
            text=texts,
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        ).to(self.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


@dataclass
class ScoredGroup:
    """One question of the step: its dataset row, what each reward function returned ([G, F],
    NaN for None), the weighted sums [G], the completions and the prompt and completions as the
    reward functions saw them."""

    row: int
    per_function: torch.Tensor
    rewards: torch.Tensor
    completion_ids: list[list[int]]
    prompts: list
    completions: list
    # Conversations (tools=): 1 on sampled tokens, 0 on tool results; None: all sampled.
    masks: list[list[int]] | None = None

    @property
    def lengths(self) -> list[int]:
        """The completions' lengths as TRL logs them: their sampled tokens."""
        if self.masks is None:
            return [len(c) for c in self.completion_ids]
        return [sum(m) for m in self.masks]


class RewardFunctionsTask:
    """Prompt ids and rewards for ``rlvr_fast.train.trainer.RLVRTrainer`` from dataset rows.
    ``Problem.id`` is the row's index; ``encode(prompt)`` gives a row's prompt ids. ``groups``
    holds the last scored step's questions. ``turns`` (tools=, ``rlvr_fast.trl_compat.tools``):
    the rollouts are conversations, which the reward functions get as completions."""

    def __init__(
        self,
        rows: list[dict],
        reward_funcs: list,
        weights: list[float],
        encode,
        *,
        gate_min_chars: int | None,
        trainer_state,
        log_metric,
        log_extra,
        normalize_each: bool = False,
        turns=None,
    ) -> None:
        self.rows, self.reward_funcs, self.normalize_each = rows, reward_funcs, normalize_each
        self.turns = turns
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.encode, self.gate_min_chars = encode, gate_min_chars
        self.trainer_state, self.log_metric, self.log_extra = trainer_state, log_metric, log_extra
        self.encoded: dict[int, list[int]] = {}
        self.groups: list[ScoredGroup] = []

    def problems(self) -> list[Problem]:
        return [
            Problem(
                id=str(i),
                question=str(row["prompt"]),
                answer=str(row.get("answer", "")),
                source="dataset",
            )
            for i, row in enumerate(self.rows)
        ]

    def prompt_ids(self, problem: Problem) -> list[int]:
        index = int(problem.id)
        if index not in self.encoded:
            self.encoded[index] = self.encode(self.rows[index]["prompt"])
        return self.encoded[index]

    def rewards(
        self, problems: list[Problem], texts: list[list[str]], completions: list[list[list[int]]]
    ) -> list[list[float]]:
        """Each question's rewards, every reward function called once over the whole step."""
        rows = [self.rows[int(p.id)] for p in problems]
        prompts, answers, ids, columns = [], [], [], {}
        for row, group_texts, group_ids in zip(rows, texts, completions, strict=True):
            conversational = is_conversational(row["prompt"])
            prompts += [copy.deepcopy(row["prompt"]) for _ in group_texts]
            if self.turns is not None:
                answers += self.turns.conversations[len(answers) : len(answers) + len(group_texts)]
            else:
                answers += [
                    [{"role": "assistant", "content": t}] if conversational else t
                    for t in group_texts
                ]
            ids += [list(c) for c in group_ids]
            for key in row:
                if key not in ("prompt", "completion", "completion_ids"):
                    columns.setdefault(key, []).extend([row[key]] * len(group_texts))
        if self.turns is not None:  # the tools/* metrics of these conversations
            self.tool_metrics = self.turns.metrics()
        per_function = self.call_functions(prompts, answers, ids, columns)
        summed = per_function
        if self.normalize_each:
            sizes = [len(group_texts) for group_texts in texts]
            summed = torch.cat([standardised_columns(g) for g in per_function.split(sizes)])
        rewards = (summed * self.weights).nansum(dim=1)
        rewards[per_function.isnan().all(dim=1)] = float("nan")
        if self.gate_min_chars is not None:
            # The study's derivation gate (an arm's gate_min_chars) on the summed reward.
            flat = [t for group in texts for t in group]
            rewards *= torch.tensor(
                [passes_gate(t, self.gate_min_chars) for t in flat], dtype=torch.float32
            )
        self.groups, start = [], 0
        for problem, group_texts in zip(problems, texts):
            part = slice(start, start + len(group_texts))
            self.groups.append(
                ScoredGroup(
                    int(problem.id),
                    per_function[part],
                    rewards[part],
                    ids[part],
                    prompts[part],
                    answers[part],
                    None if self.turns is None else self.turns.masks[part],
                )
            )
            start += len(group_texts)
        return [group.rewards.tolist() for group in self.groups]

    def call_functions(self, prompts, completions, ids, columns) -> torch.Tensor:
        """[N, F] rewards, NaN where a function returned None; coroutine functions awaited
        together."""
        arguments = dict(
            prompts=prompts,
            completions=completions,
            completion_ids=ids,
            **columns,
            trainer_state=self.trainer_state,
            log_extra=self.log_extra,
            log_metric=self.log_metric,
        )
        outputs = [None] * len(self.reward_funcs)
        pending = {}
        for index, func in enumerate(self.reward_funcs):
            if inspect.iscoroutinefunction(func):
                pending[index] = func(**arguments)
            else:
                outputs[index] = func(**arguments)
        if pending:
            done = await_all(list(pending.values()))
            outputs = [done.pop(0) if i in pending else out for i, out in enumerate(outputs)]
        per_function = torch.empty(len(prompts), len(self.reward_funcs))
        for index, (func, out) in enumerate(zip(self.reward_funcs, outputs)):
            if len(out) != len(prompts):
                raise ValueError(
                    f"reward function {callable_name(func)!r} returned {len(out)} "
                    f"rewards for {len(prompts)} completions"
                )
            per_function[:, index] = torch.tensor(
                [float("nan") if r is None else float(r) for r in out], dtype=torch.float32
            )
        return per_function


def standardised_columns(values: torch.Tensor) -> torch.Tensor:
    """Each column of one group's [G, F] rewards as (r - mean) / (std + 1e-4), NaN left out of
    the mean and the Bessel-corrected std (NaN with fewer than two), as TRL's nanstd."""
    mean = values.nanmean(dim=0, keepdim=True)
    count = (~values.isnan()).sum(dim=0, keepdim=True)
    variance = ((values - mean) ** 2).nanmean(dim=0, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))
    return (values - mean) / (std + 1e-4)


def await_all(coroutines: list, return_exceptions: bool = False) -> list:
    """The coroutines' results, awaited together (``asyncio.gather``); in a thread whose event
    loop already runs (a notebook's), on a loop of a worker thread, as TRL runs them on a loop
    of its own."""
    import concurrent.futures

    async def gather() -> list:
        return list(await asyncio.gather(*coroutines, return_exceptions=return_exceptions))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        return worker.submit(asyncio.run, gather()).result()
