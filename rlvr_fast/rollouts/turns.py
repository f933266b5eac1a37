"""Multi-turn rollouts (tool calling), a planner on the rollout engine.

``sample_turns(engine, prompts, n, params, next_turn, ...)`` samples a GRPO group of each prompt
as ``sample_groups`` does (each prompt prefilled once and forked n times), then, for as many rounds
as ``max_rounds`` allows, asks ``next_turn(row, completion)`` of every row whose turn just ended
what to append: the token ids of a turn the planner does not sample (a tool's result, rendered by
the caller's chat template), or None to end the row. An appended turn is an ``extend`` of the
live sequence: its cache is kept between rounds, so the conversation so far is never prefilled
again and a round's prefill is the appended tokens (and the last sampled token of the turn
before, which no pass has run yet). Every row's completion is the concatenation of its turns,
with a mask that is 1 on sampled tokens and 0 on appended ones. A sampled turn stops at EOS, at
``params.max_new_tokens`` or where the whole completion reaches ``max_completion_tokens``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rlvr_fast.engine import EngineCounters, RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.rollouts.generation import base_seed

# (row, its completion so far) -> the ids of the turn to append, or None: the row ends here.
NextTurn = Callable[[int, list[int]], "list[int] | None"]


@dataclass
class TurnsOutput:
    """Per row (prompt-major, as ``sample_groups``): the completion (every turn, EOS kept),
    its loss mask (1 sampled, 0 appended), its turns' token counts (sampled and appended
    alternately, starting with a sampled one), why its last sampled turn that ran stopped ("eos"
    or "cap"); ``counters``: the engine's work for them all."""

    tokens: list[list[int]]
    masks: list[list[int]]
    turns: list[list[int]]
    finish_reasons: list[str]
    counters: EngineCounters


def sample_turns(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    n: int,
    params: SamplingParams,
    next_turn: NextTurn,
    *,
    max_rounds: int,
    max_completion_tokens: int,
    bases: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> TurnsOutput:
    """Rows of n completions of each prompt, each continued by up to ``max_rounds`` appended
    turns (module docstring). Row q n + i draws from ``derive_seed(bases[q], i)`` (``bases``
    default to one ``base_seed`` draw per prompt), so its first turn is ``sample_groups``'s."""
    if n < 1 or not prompts:
        raise ValueError(f"sample_turns: need prompts and n >= 1, got {len(prompts)} and {n}")
    if max_rounds < 0 or max_completion_tokens < 1:
        raise ValueError("sample_turns: need max_rounds >= 0 and max_completion_tokens >= 1")
    if bases is None:
        bases = [base_seed(generator) for _ in prompts]
    rows, turns = [], []
    with engine.measure() as counters:
        try:
            for prompt, base in zip(prompts, bases):
                source = engine.add(prompt)
                try:
                    seeds = [derive_seed(base, i) for i in range(n)]
                    rows += engine.fork(source, n=n, seeds=seeds, keep_cache=True)
                finally:
                    engine.free(source)
            starts = [len(row.token_ids) for row in rows]
            cap = min(params.max_new_tokens, max_completion_tokens)
            engine.run(rows, dataclasses.replace(params, max_new_tokens=cap))
            turns = [[row.num_generated] for row in rows]
            reasons = [row.finish_reason for row in rows]
            live = list(range(len(rows)))
            for _ in range(max_rounds):
                live = _append_turns(
                    engine,
                    rows,
                    starts,
                    turns,
                    live,
                    next_turn,
                    max_completion_tokens,
                    params.max_new_tokens,
                )
                if not live:
                    break
                engine.run([rows[i] for i in live], params)
                for i in live:
                    turns[i].append(rows[i].num_generated)
                    reasons[i] = rows[i].finish_reason
        finally:
            for row in rows:
                engine.free(row)
    tokens = [row.token_ids[start:] for row, start in zip(rows, starts)]
    masks = [_mask(row_turns) for row_turns in turns]
    return TurnsOutput(tokens, masks, turns, reasons, counters)


def _append_turns(
    engine, rows, starts, turns, live, next_turn, cap: int, turn_cap: int
) -> list[int]:
    """Extend each live row by the turn ``next_turn`` gives it; returns the rows that sample
    again (those with tokens left under the ``cap``; a row whose appended turn fills it ends
    there, with a sampled turn of 0 tokens after it)."""
    again = []
    for i in live:
        row = rows[i]
        appended = next_turn(i, row.token_ids[starts[i] :])
        if not appended:
            continue
        left = cap - (len(row.token_ids) - starts[i]) - len(appended)
        if left < 0:
            raise ValueError(
                f"sample_turns: row {i}'s appended turn passes the completion cap of {cap} "
                "tokens (next_turn must leave it out)"
            )
        engine.extend(row, appended)
        turns[i].append(len(appended))
        if left == 0:
            turns[i].append(0)
            continue
        row.max_new_tokens = min(left, turn_cap)
        again.append(i)
    return again


def _mask(turns: list[int]) -> list[int]:
    """1 on the tokens of sampled turns (even positions), 0 on appended ones."""
    mask = []
    for index, count in enumerate(turns):
        mask += [1 - index % 2] * count
    return mask
