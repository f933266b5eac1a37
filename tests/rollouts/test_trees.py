"""Tree rollouts: the seed's PASS-2 sampler facts, the three branching rules, fork == re-prefill."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import FINISH_EOS, FINISH_STOP, RolloutEngine
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.models.policy import load_policy
from rlvr_fast.rollouts.trees import (
    find_midpoint_boundary,
    plan_branches,
    sample_tree,
    sample_tree_ids,
)

EOS, NEWLINE = 0, 1


def coin_model() -> Qwen3ForCausalLM:
    """A two-token policy, {EOS, newline}, each with probability 1/2 at every step (zero LM
    head): it emits an immediate EOS with p = 1/2 and otherwise crosses the branching boundary
    at t = 1, the finite policy of the seed's PASS 2."""
    config = ModelConfig.from_hf_dict(
        dict(
            model_type="qwen3",
            vocab_size=2,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def coin_engine() -> RolloutEngine:
    return RolloutEngine(coin_model(), eos_token_ids=[EOS], kv_blocks=64, block_size=4)


def eos_frequency_per_branch(mode: str, trees: int) -> list[float]:
    engine, generator = coin_engine(), torch.Generator().manual_seed(7)
    hits = [0, 0]
    for _ in range(trees):
        out = sample_tree_ids(
            engine,
            [NEWLINE],
            newline_token_ids=[NEWLINE],
            k=4,
            b=2,
            t_min=1,
            t_max=1,
            max_new_tokens=4,
            early_eos_mode=mode,
            generator=generator,
        )
        for pair in out.pairs:
            for branch, leaf in enumerate(pair.leaves):
                hits[branch] += leaf == [EOS]
    return [h / (4 * trees) for h in hits]


# 300 trees = 1,200 leaves per branch: the binomial standard error at p = 1/2 is 0.0144, so a
# 5-sigma band of +-0.072 still separates 0.25 from 0.5 by more than three band widths.
TREES, BAND = 300, 0.072


def test_stopped_tree_keeps_both_branches_on_policy():
    branch1, branch2 = eos_frequency_per_branch("terminal_dup", TREES)
    assert abs(branch1 - 0.5) < BAND and abs(branch2 - 0.5) < BAND


def test_root_restart_biases_the_second_branch_to_p_squared():
    branch1, branch2 = eos_frequency_per_branch("root_resample", TREES)
    assert abs(branch1 - 0.5) < BAND and abs(branch2 - 0.25) < BAND


def test_prefix_lengths_of_the_coin_policy_match_the_seed():
    engine, generator = coin_engine(), torch.Generator().manual_seed(3)
    for mode, early in (("terminal_dup", 1), ("root_resample", 0)):
        for _ in range(20):
            out = sample_tree_ids(
                engine,
                [NEWLINE],
                newline_token_ids=[NEWLINE],
                t_min=1,
                t_max=1,
                max_new_tokens=4,
                early_eos_mode=mode,
                generator=generator,
            )
            for pair in out.pairs:
                eos_first = pair.root_tokens == [EOS]
                assert pair.prefix_len == (early if eos_first else 1)
                for leaf, length in zip(pair.leaves, pair.lengths):
                    assert length <= 4 and leaf[-1] == EOS or length == 4


def test_plan_branches_follows_each_rule():
    newline = frozenset({NEWLINE})
    split = plan_branches([5, 6, NEWLINE], FINISH_STOP, 2, "terminal_dup", newline, 32)
    assert (split.category, split.prefix_len, split.prefixes) == (
        "causal_non_eos",
        3,
        [[5, 6, NEWLINE], [5, 6, NEWLINE]],
    )
    terminal = plan_branches([5, EOS], FINISH_EOS, 2, "terminal_dup", newline, 32)
    assert (terminal.category, terminal.prefix_len, terminal.prefixes, terminal.leaves) == (
        "terminal_dup",
        2,
        [None, None],
        [[5, EOS], [5, EOS]],
    )
    restart = plan_branches([5, EOS], FINISH_EOS, 2, "root_resample", newline, 32)
    assert (restart.category, restart.prefix_len, restart.prefixes, restart.leaves[0]) == (
        "tau_zero",
        0,
        [None, []],
        [5, EOS],
    )
    long_root = [5] * 10 + [NEWLINE] + [5] * 10 + [NEWLINE] + [5] * 12 + [EOS]  # 35 tokens
    midpoint = plan_branches(long_root, FINISH_EOS, 2, "midpoint", newline, 32)
    assert (midpoint.category, midpoint.prefix_len) == ("midpoint_fallback", 22)
    assert midpoint.prefixes == [None, long_root[:22]] and midpoint.leaves[0] == long_root
    longer = [5] * 60 + [NEWLINE] + [5] * 50 + [EOS]
    assert (
        plan_branches(longer, FINISH_EOS, 2, "midpoint", newline, 32).category == "early_eos_gt104"
    )
    short = plan_branches([5, NEWLINE, 5, EOS], FINISH_EOS, 2, "midpoint", newline, 32)
    assert (short.category, short.prefix_len) == ("tau_zero", 0), "too short to split"
    no_newline = plan_branches([5] * 40 + [EOS], FINISH_EOS, 2, "midpoint", newline, 32)
    assert no_newline.category == "tau_zero"


def test_midpoint_boundary_is_the_newline_split_nearest_the_middle():
    newline = frozenset({NEWLINE})
    assert find_midpoint_boundary([5, NEWLINE, 5, 5, 5, NEWLINE, 5, 5, EOS], newline) == 6
    assert find_midpoint_boundary([5, NEWLINE, 5, NEWLINE, EOS], newline) == 2
    assert find_midpoint_boundary([5, 5, 5, EOS], newline) is None
    assert find_midpoint_boundary([5, 5, NEWLINE], newline) is None, "no interior boundary"


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


@pytest.mark.parametrize("mode", ["terminal_dup", "root_resample", "midpoint"])
def test_fork_path_samples_what_re_prefill_samples(tiny, mode):
    """Same generator, same tokens; forking runs one prompt prefill and no Stage-2 prefill,
    copies at most one block per root and per branch, holds no more KV blocks at its peak, and
    gives every block back."""
    problems = synthetic_problems("train", 2)
    engine = RolloutEngine.for_policy(tiny, kv_blocks=256)
    for seed, problem in enumerate(problems):
        prompt = tiny.tokenizer.encode(render_prompt(problem.question))
        runs = [
            sample_tree(
                tiny,
                prompt,
                engine=engine,
                t_min=6,
                t_max=12,
                max_new_tokens=40,
                early_eos_mode=mode,
                generator=torch.Generator().manual_seed(seed),
                reprefill=reprefill,
            )
            for reprefill in (False, True)
        ]
        forked, reprefilled = runs
        assert forked.leaves == reprefilled.leaves
        assert [p.category for p in forked.pairs] == [p.category for p in reprefilled.pairs]
        assert forked.stage2.prefill_run == 0
        assert forked.stage1.prefill_run == len(prompt)
        assert reprefilled.stage1.prefill_run == 4 * len(prompt)
        continued = sum(sum(p.continued) for p in forked.pairs)
        assert reprefilled.stage2.prefill_run == sum(
            len(prompt) + (p.prefix_len if p.category != "tau_zero" else 0)
            for p in forked.pairs
            for c in p.continued
            if c
        )
        assert forked.executed.block_copies <= 4 + continued
        assert forked.executed.peak_kv_blocks <= reprefilled.executed.peak_kv_blocks
        assert forked.stage1_generated == sum(len(p.root_tokens) for p in forked.pairs)
        assert engine.blocks_in_use == 0
        for pair in forked.pairs:
            for leaf in pair.leaves:
                assert leaf[: pair.prefix_len] == pair.root_tokens[: pair.prefix_len]
                assert len(leaf) <= 40


def test_bad_arguments_are_one_line_errors(tiny):
    with pytest.raises(ValueError, match="early_eos_mode must be one of"):
        sample_tree(tiny, [1, 2], early_eos_mode="nope")
    with pytest.raises(ValueError, match="t_max \\(600\\) must be below max_new_tokens"):
        sample_tree(tiny, [1, 2], t_min=10, t_max=600)
    with pytest.raises(ValueError, match="at least one token"):
        sample_tree(tiny, [])


def test_midpoint_split_of_a_long_early_eos_root_on_the_tiny_model(tiny, tmp_path):
    """Roots that finish their derivation (EOS) before tau_causal are split at their middle
    newline: branch 1 keeps the root, branch 2 shares its first m tokens; the fork path matches
    re-prefill, and a trainer step on such trees writes ledger lines that pass every law."""
    problem = synthetic_problems("train", 3, seed=1)[2]
    prompt = tiny.tokenizer.encode(render_prompt(problem.question))
    runs = [
        sample_tree(
            tiny,
            prompt,
            t_min=120,
            t_max=150,
            max_new_tokens=200,
            early_eos_mode="midpoint",
            generator=torch.Generator().manual_seed(0),
            reprefill=reprefill,
        )
        for reprefill in (False, True)
    ]
    assert runs[0].leaves == runs[1].leaves
    split = [p for p in runs[0].pairs if p.category == "midpoint_fallback"]
    assert split, "the tiny model's derivations end before tau_causal"
    for pair in split:
        assert pair.leaves[0] == pair.root_tokens
        assert pair.leaves[1][: pair.prefix_len] == pair.root_tokens[: pair.prefix_len]
        assert pair.root_tokens[pair.prefix_len - 1] in tiny.tokenizer.newline_token_ids
        assert 1 <= pair.prefix_len < len(pair.root_tokens)

    from rlvr_fast.train.trainer import RLVRTrainer
    from rlvr_fast.train.config import TrainConfig

    config = TrainConfig.from_arm(
        "midpoint_mst",
        steps=1,
        t_min=120,
        t_max=150,
        max_new_tokens=200,
        gate_min_chars=None,
        seed=0,
    )
    trainer = RLVRTrainer(tiny, config, [problem], out_dir=tmp_path, progress=False)
    trainer.train()
    line = json.loads((tmp_path / "ledger.jsonl").read_text())
    # Same seed, same prompt, first step a tree: the trainer sampled the very same tree.
    assert [pair[6] for pair in line["pairs"]] == [p.category for p in runs[0].pairs]
    assert [pair[0] for pair in line["pairs"]] == runs[0].prefix_lens
    assert line["lengths"] == runs[0].lengths
