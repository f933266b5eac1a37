"""Flat sampling, a planner on the rollout engine.

- ``generate(engine, prompts, params)``: one completion per prompt (token-id lists), every prompt
  prefilled on its own, all continuously batched;
- ``sample_group(engine, prompt, n, params)``: a GRPO group, n completions of one prompt that is
  prefilled once and forked n times (``reprefill=True``: prefilled n times, the seed's way; the
  same tokens either way);
- ``sample_groups(engine, prompts, n, params)``: one such group per prompt, all sampled in one
  continuously batched run (a multi-question step);
- ``sample(policy, prompts, params)``: strings in, texts out, on the policy's engine.

Each completion draws from its own stream, seeded by ``derive_seed(base, i)`` from one draw of
the caller's generator, so completion i is the same whatever else is in the batch. A completion
ends at its first end-of-sequence token (kept) or at ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlvr_fast.engine import EngineCounters, RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed


@dataclass
class SampleOutput:
    """Per completion (prompt order): generated ids (EOS kept), and why it stopped ("eos" or
    "cap"); ``counters``: the work the engine executed for them."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    counters: EngineCounters
    texts: list[str] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def generated_tokens(self) -> int:
        return sum(self.lengths)


def base_seed(generator: torch.Generator | None) -> int:
    """One draw from ``generator`` (torch's default generator when None): the root of a call's
    sampling streams."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def generate(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    on_finish=None,
) -> SampleOutput:
    """One completion per prompt; ``on_finish(index)`` is called as each one finishes."""
    if not prompts:
        raise ValueError("generate: no prompts")
    base = base_seed(generator)
    seqs = [engine.add(prompt, seed=derive_seed(base, i)) for i, prompt in enumerate(prompts)]
    index = {id(seq): i for i, seq in enumerate(seqs)}
    callback = None if on_finish is None else (lambda seq: on_finish(index[id(seq)]))
    with engine.measure() as counters:
        engine.run(seqs, params, on_finish=callback)
    return SampleOutput(
        [seq.completion for seq in seqs], [seq.finish_reason for seq in seqs], counters
    )


def sample_group(
    engine: RolloutEngine,
    prompt: Sequence[int],
    n: int,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    reprefill: bool = False,
) -> SampleOutput:
    """n completions of one prompt: prefilled once and forked n times (prefill_run = |prompt|),
    or with ``reprefill`` prefilled n times (prefill_run = n |prompt|)."""
    return sample_groups(engine, [prompt], n, params, generator=generator, reprefill=reprefill)


def sample_groups(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    n: int,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    bases: Sequence[int] | None = None,
    reprefill: bool = False,
) -> SampleOutput:
    """n completions of each prompt, all in one engine run; rows are prompt-major (row q n + i is
    completion i of prompt q) and ``counters`` is the work of the whole batch. Completion i of
    prompt q draws from ``derive_seed(bases[q], i)``; ``bases`` default to one ``base_seed``
    draw per prompt, in order, so a one-prompt call samples what ``sample_group`` samples."""
    if n < 1:
        raise ValueError(f"sample_groups: n must be >= 1, got {n}")
    if not prompts:
        raise ValueError("sample_groups: no prompts")
    if bases is None:
        bases = [base_seed(generator) for _ in prompts]
    elif len(bases) != len(prompts):
        raise ValueError(f"sample_groups: {len(prompts)} bases needed, got {len(bases)}")
    rows = []
    with engine.measure() as counters:
        try:
            for prompt, base in zip(prompts, bases):
                seeds = [derive_seed(base, i) for i in range(n)]
                if reprefill:
                    rows += [engine.add(prompt, seed=seed) for seed in seeds]
                    continue
                source = engine.add(prompt)
                try:
                    rows += engine.fork(source, n=n, seeds=seeds)
                finally:
                    engine.free(source)
            engine.run(rows, params)
        except BaseException:
            # Forks made before a failure hold blocks until freed; run frees only what it ran.
            for row in rows:
                engine.free(row)
            raise
    return SampleOutput(
        [seq.completion for seq in rows], [seq.finish_reason for seq in rows], counters
    )


def sample(
    policy,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    *,
    generator: torch.Generator | None = None,
    engine: RolloutEngine | None = None,
) -> SampleOutput:
    """Sample from a ``Policy`` (on ``engine``, default the policy's own); prompts are strings
    (tokenized here) or token-id lists. The output's ``texts`` are the decoded completions
    without special tokens."""
    tokenizer = policy.tokenizer
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    out = generate(
        engine or RolloutEngine.shared(policy),
        prompt_ids,
        params or SamplingParams(),
        generator=generator,
    )
    out.texts = tokenizer.decode_batch(out.tokens)
    return out
