"""Two-stage tree rollouts (seed §4.2): K roots, each stopped prefix continued B times, on the
paged KV cache so that Stage 2 forks each prefix instead of re-prefilling it.

Stage 1 samples K roots from the prompt. Root k stops at

    tau_causal = min(t_max, first t >= t_min whose token contains a newline)

or at its end-of-sequence token T_EOS, whichever comes first: both are stopping times of the
token filtration, so the stop is decided as the token arrives and no root decodes past it.
Stage 2 gives every pair B leaves according to ``early_eos_mode``:

- ``terminal_dup`` (stopped tree, arms 5-6): tau_k = min(tau_causal, T_EOS). A root that stopped
  at a newline is continued B times from its prefix (``causal_non_eos``); a root that ended in
  EOS is an absorbing terminal leaf, duplicated B times with zero-length continuations
  (``terminal_dup``). Every leaf has the sampling policy's exact marginal.
- ``root_resample`` (root restart, arms 7-8): an early-EOS root sets tau_k = 0 after the fact;
  branch 1 keeps the EOS sequence and the other branches are drawn afresh from the prompt
  (``tau_zero``). The event depends on the outcome, so sibling marginals are biased
  (P(EOS) = p on branch 1, p^2 on branch 2 for a policy with immediate-EOS probability p).
- ``midpoint`` (midpoint fallback, arms 9-10): an early-EOS root of at least
  ``midpoint_min_tokens`` tokens keeps its whole trajectory as branch 1 and splits the other
  branches at the interior newline boundary nearest its midpoint (``midpoint_fallback``, or
  ``early_eos_gt104`` when the root ran past 104 tokens before its EOS: the seed counts those
  apart); shorter early-EOS roots, or ones without an interior newline, restart at the root as
  in ``root_resample``.

Forking: on the rollout engine, Stage 1 prefills the prompt once and forks it K times (each
root draws its first token from the prompt's logits); a branch from prefix u forks its root (or
the prompt) at |prompt| + |u| tokens, sharing the first |prompt| + |u| - 1 cached tokens and
running u's last token as a decode row, so Stage 2 runs no prefill at all and copies at most one
block per branch; a branch restarted at the prompt shares the prompt and its logits. A branch
frees its blocks the moment it finishes. ``reprefill=True`` runs the seed's way instead: every
root prefills the prompt and every branch prefills prompt + prefix. Every root and branch draws
from its own stream, keyed by its place in the tree (root k, branch (k, b)), so both ways sample
the same tokens (the tests check this).

``sample_trees_ids`` samples the trees of several prompts in one batch (a multi-question step):
every tree's Stage 1 in one engine run, then every tree's Stage 2 in another; tree q keys its
streams on its own base seed, so it is the tree a one-prompt call would sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlvr_fast.engine import FINISH_STOP, EngineCounters, RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.rollouts.generation import base_seed
from rlvr_fast.rollouts.pairs import EARLY_EOS_GT104_MIN_LENGTH, PairCategory, TreePair

EARLY_EOS_MODES = ("terminal_dup", "root_resample", "midpoint")


@dataclass
class TreeRollout:
    """K pairs of B leaves (k-major) and what producing them cost: Stage-1 tokens sampled
    (trimmed at each root's stop), Stage-2 tokens sampled, and the work the engine executed in
    each stage and in all (its ``peak_kv_blocks`` is the whole tree's). Trees sampled together
    (``sample_trees_ids``) share one batch, so their three counters are the batch's."""

    pairs: list[TreePair]
    prompt_len: int
    stage1_generated: int
    stage2_generated: int
    stage1: EngineCounters
    stage2: EngineCounters
    executed: EngineCounters
    texts: list[str] = field(default_factory=list)

    @property
    def leaves(self) -> list[list[int]]:
        return [leaf for pair in self.pairs for leaf in pair.leaves]

    @property
    def lengths(self) -> list[int]:
        return [len(leaf) for leaf in self.leaves]

    @property
    def prefix_lens(self) -> list[int]:
        """tau_k per pair."""
        return [pair.prefix_len for pair in self.pairs]

    @property
    def leaf_prefix_lens(self) -> list[int]:
        """The shared-prefix length of every leaf, in leaf order."""
        return [pair.prefix_len for pair in self.pairs for _ in pair.leaves]


def sample_tree(
    policy, prompt_ids: Sequence[int], *, engine: RolloutEngine | None = None, **settings
) -> TreeRollout:
    """K x B tree rollout of one prompt from a ``Policy`` (on ``engine``, default the policy's
    own); ``settings`` are those of ``sample_trees_ids``."""
    tokenizer = policy.tokenizer
    out = sample_tree_ids(
        engine or RolloutEngine.shared(policy),
        prompt_ids,
        newline_token_ids=tokenizer.newline_token_ids,
        **settings,
    )
    out.texts = tokenizer.decode_batch(out.leaves)
    return out


def sample_tree_ids(engine: RolloutEngine, prompt_ids: Sequence[int], **settings) -> TreeRollout:
    """The K x B tree of one prompt on ``engine``; ``settings`` are those of
    ``sample_trees_ids``."""
    return sample_trees_ids(engine, [prompt_ids], **settings)[0]


def sample_trees_ids(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    *,
    newline_token_ids: Sequence[int] | frozenset[int],
    k: int = 4,
    b: int = 2,
    t_min: int = 96,
    t_max: int = 160,
    max_new_tokens: int = 512,
    early_eos_mode: str = "terminal_dup",
    temperature: float = 0.8,
    top_p: float = 0.9,
    sampler_options: dict | None = None,
    generator: torch.Generator | None = None,
    bases: Sequence[int] | None = None,
    reprefill: bool = False,
    midpoint_min_tokens: int = 32,
) -> list[TreeRollout]:
    """One K x B tree per prompt on ``engine`` (whose end-of-sequence tokens end a root or a
    branch), given the newline token ids that mark Stage 1's boundaries. Every tree's Stage 1
    runs in one batch, then every tree's Stage 2 in another. Tree q draws from its own base
    seed ``bases[q]`` (default: one ``base_seed`` draw per prompt, in order), so a one-prompt
    call samples the tree ``sample_tree_ids`` samples and a tree does not depend on the
    others. ``sampler_options``: ``SamplingParams``' top_k, min_p, repetition_penalty."""
    if not prompts:
        raise ValueError("sample_tree: no prompts")
    for prompt_ids in prompts:
        _check_arguments(prompt_ids, k, b, t_min, t_max, max_new_tokens, early_eos_mode)
    prompts = [list(prompt_ids) for prompt_ids in prompts]
    params = SamplingParams(max_new_tokens, temperature, top_p, **(sampler_options or {}))
    newline = frozenset(newline_token_ids)
    if bases is None:
        bases = [base_seed(generator) for _ in prompts]
    elif len(bases) != len(prompts):
        raise ValueError(f"sample_tree: {len(prompts)} bases needed, got {len(bases)}")

    def causal_stop(length: int, token: int) -> bool:
        return length >= t_max or (length >= t_min and token in newline)

    prompt_seqs, roots, children = [], [], []
    try:
        with engine.measure() as executed:
            # Stage 1: K roots per prompt, each stopped at tau_causal or at its EOS; kept cached
            # until Stage 2 has forked them (a midpoint split forks a finished one).
            with engine.measure() as stage1:
                for prompt, base in zip(prompts, bases):
                    root_seeds = [derive_seed(base, root) for root in range(k)]
                    if reprefill:
                        roots.append(
                            [engine.add(prompt, seed=seed, stop=causal_stop) for seed in root_seeds]
                        )
                        continue
                    prompt_seqs.append(engine.add(prompt))
                    roots.append(
                        engine.fork(
                            prompt_seqs[-1],
                            n=k,
                            seeds=root_seeds,
                            stop=causal_stop,
                            keep_cache=True,
                        )
                    )
                engine.run([root for tree in roots for root in tree], params)
            # Stage 2: plan every pair's branches, fork (or re-prefill) the ones that continue.
            plans = [
                [
                    plan_branches(
                        root.completion,
                        root.finish_reason,
                        b,
                        early_eos_mode,
                        newline,
                        midpoint_min_tokens,
                    )
                    for root in tree
                ]
                for tree in roots
            ]
            starts = branch_starts(plans)
            with engine.measure() as stage2:
                for q, pair, branch, prefix in starts:
                    seed = derive_seed(bases[q], k + pair * b + branch)
                    budget = max_new_tokens - len(prefix)
                    if reprefill:
                        children.append(
                            engine.add(prompts[q] + prefix, seed=seed, max_new_tokens=budget)
                        )
                    else:
                        source = roots[q][pair] if prefix else prompt_seqs[q]
                        children += engine.fork(
                            source,
                            len(prompts[q]) + len(prefix),
                            seeds=[seed],
                            max_new_tokens=budget,
                        )
                _free(engine, [root for tree in roots for root in tree] + prompt_seqs)
                engine.run(children, params)
    finally:
        _free(engine, [root for tree in roots for root in tree] + prompt_seqs + children)
    counters = (stage1, stage2, executed)
    return assemble_trees(prompts, plans, roots, starts, children, counters)


def branch_starts(plans: list[list["BranchPlan"]]) -> list[tuple[int, int, int, list[int]]]:
    """(tree, pair, branch, prefix) of every branch Stage 2 continues, in tree, pair, branch
    order (the order of their seeds and of the engine's batch)."""
    return [
        (q, pair, branch, prefix)
        for q, tree in enumerate(plans)
        for pair, plan in enumerate(tree)
        for branch, prefix in enumerate(plan.prefixes)
        if prefix is not None
    ]


def assemble_trees(prompts, plans, roots, starts, children, counters) -> list[TreeRollout]:
    """Each prompt's tree from its roots, its branch plans and the continued branches."""
    stage1, stage2, executed = counters
    stage2_generated = [0] * len(prompts)
    for (q, pair, branch, prefix), child in zip(starts, children):
        plans[q][pair].leaves[branch] = prefix + child.completion
        plans[q][pair].finish_reasons[branch] = child.finish_reason
        stage2_generated[q] += child.num_generated
    return [
        TreeRollout(
            pairs=[
                TreePair(
                    plan.category,
                    plan.prefix_len,
                    root.completion,
                    plan.leaves,
                    plan.finish_reasons,
                )
                for plan, root in zip(tree_plans, tree_roots)
            ],
            prompt_len=len(prompt),
            stage1_generated=sum(root.num_generated for root in tree_roots),
            stage2_generated=generated,
            stage1=stage1,
            stage2=stage2,
            executed=executed,
        )
        for prompt, tree_plans, tree_roots, generated in zip(
            prompts, plans, roots, stage2_generated
        )
    ]


def _free(engine: RolloutEngine, seqs) -> None:
    for seq in seqs:
        if seq is not None:
            engine.free(seq)


@dataclass
class BranchPlan:
    """Branch b continues from ``prefixes[b]`` (None: its leaf is already complete in
    ``leaves[b]``)."""

    category: PairCategory
    prefix_len: int
    prefixes: list[list[int] | None]
    leaves: list[list[int]]
    finish_reasons: list[str]


def plan_branches(
    root: list[int],
    reason: str,
    b: int,
    mode: str,
    newline: frozenset[int],
    midpoint_min_tokens: int,
) -> BranchPlan:
    """What Stage 2 does with a root that stopped for ``reason`` (``FINISH_STOP`` at tau_causal
    or ``FINISH_EOS``), under ``mode``: the rule table of the three samplers."""
    if reason == FINISH_STOP:
        return BranchPlan(
            PairCategory.CAUSAL_NON_EOS, len(root), [root] * b, [[] for _ in range(b)], [""] * b
        )
    if mode == "terminal_dup":
        return BranchPlan(
            PairCategory.TERMINAL_DUP,
            len(root),
            [None] * b,
            [list(root) for _ in range(b)],
            [reason] * b,
        )
    split = (
        find_midpoint_boundary(root, newline)
        if mode == "midpoint" and len(root) >= midpoint_min_tokens
        else None
    )
    if split is None:
        return BranchPlan(
            PairCategory.TAU_ZERO,
            0,
            [None] + [[] for _ in range(b - 1)],
            [list(root)] + [[] for _ in range(b - 1)],
            [reason] + [""] * (b - 1),
        )
    # Long early-EOS roots are counted as their own midpoint category (seed §4.2).
    category = (
        PairCategory.EARLY_EOS_GT104
        if len(root) >= EARLY_EOS_GT104_MIN_LENGTH
        else PairCategory.MIDPOINT_FALLBACK
    )
    return BranchPlan(
        category,
        split,
        [None] + [root[:split]] * (b - 1),
        [list(root)] + [[] for _ in range(b - 1)],
        [reason] + [""] * (b - 1),
    )


def find_midpoint_boundary(tokens: Sequence[int], newline: frozenset[int]) -> int | None:
    """The split point s (prefix = tokens[:s], 1 <= s < len(tokens)) right after a newline
    token, nearest to len(tokens) / 2 (the earlier one on a tie); None if there is none."""
    boundaries = [s for s in range(1, len(tokens)) if tokens[s - 1] in newline]
    if not boundaries:
        return None
    return min(boundaries, key=lambda s: (abs(2 * s - len(tokens)), s))


def _check_arguments(prompt_ids, k, b, t_min, t_max, max_new_tokens, mode) -> None:
    checks = [
        (len(prompt_ids) >= 1, "the prompt needs at least one token"),
        (k >= 1 and b >= 1 and k * b >= 2, f"need k >= 1, b >= 1 and k * b >= 2, got k={k}, b={b}"),
        (1 <= t_min <= t_max, f"need 1 <= t_min <= t_max, got t_min={t_min}, t_max={t_max}"),
        (
            t_max < max_new_tokens,
            f"t_max ({t_max}) must be below max_new_tokens ({max_new_tokens})",
        ),
        (
            mode in EARLY_EOS_MODES,
            f"early_eos_mode must be one of {', '.join(EARLY_EOS_MODES)}, got {mode!r}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"sample_tree: {message}")
