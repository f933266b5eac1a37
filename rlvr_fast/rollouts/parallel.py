"""Parallel-path rollouts (the Parallel-Shapley seed), a planner on the rollout engine.

Per question: R responses of K paths each. All R K paths are sampled from the prompt, which is
prefilled once and forked R K times (they share its KV blocks). Path i = r K + j (path j of
response r) samples from stream ``derive_seed(base, i)``; ``base`` is one draw of the caller's
generator, or for several prompts in one batch (``sample_parallel_batch``) each prompt's own.

Aggregators turn a response's K paths into its final answer:

- ``vote``: the majority answer of the paths (``rlvr_fast.credit.shapley.MajorityVote``); nothing is
  generated.
- ``summary``: the policy writes a summary conditioned on the prompt and all K paths, the paper's
  format. Summary r forks the prompt (sharing its blocks), is extended with
  ``summary_context(...)`` and samples from stream ``derive_seed(base, R K + r)`` with the
  paths' sampling settings. Serialisation, written down: after the prompt's ids, for each path
  k = 1..K in order, the ids of ``"\\nPath {k}:"`` then the path's own ids (its EOS dropped), then
  the ids of ``"\\nSummary:"``. The path ids are the sampled ones, never re-tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlvr_fast.engine import EngineCounters, RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.rollouts.generation import base_seed

AGGREGATORS = ("vote", "summary")
PATH_HEADER = "\nPath {k}:"
SUMMARY_HEADER = "\nSummary:"


@dataclass
class ParallelRollout:
    """``paths``: R K completions, response-major (path i = r K + j); ``summaries``: one per
    response under the summary aggregator (else empty), with their prompts (``summary_prompts``,
    the prompt and the serialised paths) and seeds; ``executed``: the engine's work for all."""

    paths: list[list[int]]
    paths_per_response: int
    executed: EngineCounters
    summary_prompts: list[list[int]] = field(default_factory=list)
    summaries: list[list[int]] = field(default_factory=list)
    summary_seeds: list[int] = field(default_factory=list)
    base: int | None = None  # the root of its sampling streams

    @property
    def responses(self) -> int:
        return len(self.paths) // self.paths_per_response

    def response_paths(self, r: int) -> list[list[int]]:
        k = self.paths_per_response
        return self.paths[r * k : (r + 1) * k]


def summary_context(paths: Sequence[Sequence[int]], encode, eos_token_ids) -> list[int]:
    """The ids a summary's prompt appends after the question's prompt (module docstring)."""
    eos = frozenset(eos_token_ids)
    ids: list[int] = []
    for k, path in enumerate(paths, start=1):
        ids += encode(PATH_HEADER.format(k=k)) + [t for t in path if t not in eos]
    return ids + encode(SUMMARY_HEADER)


def sample_parallel(
    engine: RolloutEngine,
    prompt: Sequence[int],
    *,
    responses: int,
    paths: int,
    params: SamplingParams,
    aggregator: str = "vote",
    encode=None,
    generator: torch.Generator | None = None,
) -> ParallelRollout:
    """R = ``responses`` responses of K = ``paths`` paths of one prompt; ``encode`` (text ->
    ids) is needed by the summary aggregator."""
    (out,) = sample_parallel_batch(
        engine,
        [prompt],
        [base_seed(generator)],
        responses=responses,
        paths=paths,
        params=params,
        aggregator=aggregator,
        encode=encode,
    )
    return out


def sample_parallel_batch(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    bases: Sequence[int],
    *,
    responses: int,
    paths: int,
    params: SamplingParams,
    aggregator: str = "vote",
    encode=None,
) -> list[ParallelRollout]:
    """``sample_parallel`` of several prompts in one engine batch (their paths, then their
    summaries), prompt q from base seed ``bases[q]``; every rollout's ``executed`` is the
    batch's work."""
    if responses < 1 or paths < 1:
        raise ValueError(
            f"sample_parallel: need responses >= 1 and paths >= 1, got {responses} and {paths}"
        )
    if aggregator not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {aggregator!r}")
    if aggregator == "summary" and encode is None:
        raise ValueError("the summary aggregator needs encode (the tokenizer's)")
    count = responses * paths
    sources, rows, summaries = [], [], []
    try:
        with engine.measure() as executed:
            for prompt, base in zip(prompts, bases, strict=True):
                sources.append(engine.add(prompt))
                seeds = [derive_seed(base, i) for i in range(count)]
                rows.append(engine.fork(sources[-1], n=count, seeds=seeds))
            engine.run([seq for question in rows for seq in question], params)
            outs = [
                ParallelRollout([seq.completion for seq in question], paths, executed, base=base)
                for question, base in zip(rows, bases)
            ]
            if aggregator == "summary":
                for out, source, base in zip(outs, sources, bases):
                    out.summary_seeds = [derive_seed(base, count + r) for r in range(responses)]
                    contexts = [
                        summary_context(out.response_paths(r), encode, engine.eos_token_ids)
                        for r in range(responses)
                    ]
                    summaries.append(fork_summaries(engine, source, contexts, out.summary_seeds))
                engine.run([seq for question in summaries for seq in question], params)
                for out, question in zip(outs, summaries):
                    out.summary_prompts = [list(seq.token_ids[: seq.start]) for seq in question]
                    out.summaries = [seq.completion for seq in question]
    finally:
        for seq in [*sources, *(s for q in rows + summaries for s in q)]:
            engine.free(seq)
    return outs


def summarise(
    engine: RolloutEngine,
    prompt_seq,
    contexts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    params: SamplingParams,
) -> list:
    """One summary per context: ``prompt_seq`` forked (sharing its blocks), extended with the
    context, run with ``params``; returns the finished sequences (the caller frees them)."""
    seqs = fork_summaries(engine, prompt_seq, contexts, seeds)
    try:
        engine.run(seqs, params)
    except BaseException:
        for seq in seqs:
            engine.free(seq)
        raise
    return seqs


def fork_summaries(
    engine: RolloutEngine, prompt_seq, contexts: Sequence[Sequence[int]], seeds: Sequence[int]
) -> list:
    """``prompt_seq`` forked once per context (sharing its blocks), each fork extended with its
    context, not yet run (the caller frees them)."""
    seqs = engine.fork(prompt_seq, n=len(contexts), seeds=list(seeds))
    try:
        for seq, context in zip(seqs, contexts):
            engine.extend(seq, context)
    except BaseException:
        for seq in seqs:
            engine.free(seq)
        raise
    return seqs
