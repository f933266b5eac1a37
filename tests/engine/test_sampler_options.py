"""TRL's sampler options (top_k, min_p, repetition_penalty): the torch reference keeps what
transformers' processors and warpers keep, in their order; the C++ sampler draws the
reference's tokens with them on; draws stay a function of a row's own seed, position, logits
and history; off, they change nothing."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlvr_fast.engine import RolloutEngine
from rlvr_fast.engine.token_sampler import (
    SamplingParams,
    history_of,
    penalize_repeats,
    sample_tokens,
    top_p_probs,
)
from rlvr_fast.models.checkpoint import load_model


def transformers_distribution(logits, temperature, top_p, top_k, min_p) -> torch.Tensor:
    """The renormalised distribution GRPOTrainer's generate samples from: the warpers in the
    order of transformers' ``_get_logits_processor``."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def our_distribution(logits, temperature, top_p, top_k, min_p) -> torch.Tensor:
    kept, ids = top_p_probs(logits, temperature, top_p, top_k, min_p)
    dense = torch.zeros_like(logits).scatter_(1, ids, kept)
    return dense / dense.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(3, 1.0, 0.0), (6, 0.8, 0.0), (0, 0.9, 0.2), (7, 0.7, 0.1), (1, 0.9, 0.0), (50, 0.9, 0.0)],
)
def test_the_options_keep_what_transformers_warpers_keep(top_k, top_p, min_p):
    """top-k before top-p (the top-p mass renormalised over the k first), min-p after both; a
    k past the vocabulary is no filter."""
    logits = torch.randn(16, 37, generator=torch.Generator().manual_seed(top_k)) * 2
    ours = our_distribution(logits, 0.7, top_p, top_k, min_p)
    theirs = transformers_distribution(logits, 0.7, top_p, top_k, min_p)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_top_p_after_top_k_is_renormalised():
    """p = (0.3, 0.25, 0.2, 0.15, 0.1), top_k 3, top_p 0.7: the mass before rank 2 is 0.55,
    below 0.7 but not below 0.7 x 0.75 of the renormalised distribution: two tokens."""
    logits = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]]).log()
    assert (our_distribution(logits, 1.0, 0.7, 3, 0.0) > 0).sum() == 2
    assert (our_distribution(logits, 1.0, 0.7, 0, 0.0) > 0).sum() == 3


def test_the_penalty_is_transformers_repetition_penalty():
    """Each token of the row's prompt and completion so far, counted once however often it
    repeats: positive logits divided, negative multiplied; every other logit untouched."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1)) * 3
    ids = [[1, 5, 5, 7], [0], [19, 3, 2, 2, 2, 11]]
    for penalty in (1.3, 0.7):
        ours = penalize_repeats(logits, history_of(ids), penalty)
        theirs = torch.cat(
            [
                RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([row]), logits[i : i + 1])
                for i, row in enumerate(ids)
            ]
        )
        assert torch.equal(ours, theirs)


OPTIONS = [
    dict(top_k=5),
    dict(min_p=0.1),
    dict(top_k=40, min_p=0.05, repetition_penalty=1.2),
    dict(top_k=3, repetition_penalty=0.8),
]


def streams(rows: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    seeds = torch.randint(0, 2**62, (rows,), generator=generator)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    history = torch.randint(0, vocab, (rows, 9), generator=generator)
    return logits, seeds, positions, history


@pytest.mark.parametrize("vocab,rows", [(2, 300), (211, 300), (1000, 100)])
def test_cpp_draws_equal_the_reference_with_the_options_on(vocab, rows):
    logits, seeds, positions, history = streams(rows, vocab, vocab)
    for options in OPTIONS:
        reference = sample_tokens(
            logits, seeds, positions, 0.8, 0.9, greedy=False, history=history, **options
        )
        fast = sample_tokens(
            logits,
            seeds,
            positions,
            0.8,
            0.9,
            greedy=False,
            backend="cpp",
            history=history,
            **options,
        )
        assert (fast != reference).sum() <= rows // 100, options


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_draws_pass_a_chi_square_test_against_the_rule_with_the_options_on(backend):
    """p = (0.55, 0.2, 0.1, 0.08, 0.07), top_k 4, top_p 0.95, min_p 0.15: min-p drops the 0.08
    that top-p keeps, top-k the 0.07; 20,000 streams draw the three kept tokens in proportion
    (chi-square, 2 degrees of freedom, p > 0.001)."""
    probs = [0.55, 0.2, 0.1, 0.08, 0.07]
    draws = 20000
    logits = torch.tensor([probs]).log().expand(draws, -1).contiguous()
    seeds = torch.arange(draws)
    tokens = sample_tokens(
        logits,
        seeds,
        torch.zeros_like(seeds),
        1.0,
        0.95,
        greedy=False,
        backend=backend,
        top_k=4,
        min_p=0.15,
    )
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert counts[3] == counts[4] == 0
    expected = {t: probs[t] / sum(probs[:3]) for t in range(3)}
    chi_square = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    assert chi_square < 13.8, (counts, chi_square)
    assert math.isclose(sum(expected.values()), 1.0)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_a_draw_depends_only_on_its_own_row_with_the_options_on(backend):
    logits, seeds, positions, history = streams(9, 60, 3)
    options = dict(top_k=10, min_p=0.02, repetition_penalty=1.5, backend=backend)
    tokens = sample_tokens(
        logits, seeds, positions, 0.8, 0.9, greedy=False, history=history, **options
    )
    order = torch.randperm(9, generator=torch.Generator().manual_seed(0))
    shuffled = sample_tokens(
        logits[order],
        seeds[order],
        positions[order],
        0.8,
        0.9,
        greedy=False,
        history=history[order],
        **options,
    )
    assert torch.equal(shuffled, tokens[order])
    alone = sample_tokens(
        logits[4:5],
        seeds[4:5],
        positions[4:5],
        0.8,
        0.9,
        greedy=False,
        history=history[4:5],
        **options,
    )
    assert int(alone) == int(tokens[4])


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_options_off_draw_what_the_plain_rule_draws(backend):
    logits, seeds, positions, history = streams(64, 300, 4)
    plain = sample_tokens(logits, seeds, positions, 0.8, 0.9, greedy=False, backend=backend)
    off = sample_tokens(
        logits,
        seeds,
        positions,
        0.8,
        0.9,
        greedy=False,
        backend=backend,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        history=history,
    )
    assert torch.equal(plain, off)


def test_greedy_decoding_takes_the_penalty_too():
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    history = torch.tensor([[0]])
    for backend in ("torch", "cpp"):
        tokens = sample_tokens(
            logits,
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            0.0,
            1.0,
            greedy=True,
            backend=backend,
            repetition_penalty=1.2,
            history=history,
        )
        assert tokens.tolist() == [1]


def test_a_penalty_without_history_is_refused():
    with pytest.raises(ValueError, match="history"):
        sample_tokens(
            torch.zeros(1, 4),
            torch.zeros(1),
            torch.zeros(1),
            1.0,
            1.0,
            greedy=False,
            repetition_penalty=1.1,
        )


@pytest.mark.parametrize(
    "kwargs,message",
    [({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": 1.5}, "min_p")]
    + [({"repetition_penalty": 0.0}, "repetition_penalty")],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_an_engine_rows_completion_does_not_depend_on_its_batch_with_the_options_on(hf_qwen3):
    """The penalty reads each row's own prompt and completion: a row forked with three others
    generates what it generates alone."""
    model = load_model(hf_qwen3[1])
    params = SamplingParams(max_new_tokens=8, top_k=20, min_p=0.01, repetition_penalty=1.3)

    def completions(seeds, params=params):
        engine = RolloutEngine(model, kv_blocks=64, block_size=4, eos_token_ids=[0])
        prompt = engine.add([5, 6, 7, 5, 6])
        rows = engine.fork(prompt, n=len(seeds), seeds=seeds)
        engine.free(prompt)
        engine.run(rows, params)
        return [row.completion for row in rows]

    together = completions([11, 12, 13, 14])
    assert [completions([seed])[0] for seed in (12, 14)] == [together[1], together[3]]
    plain = SamplingParams(max_new_tokens=8)
    assert completions([11, 12, 13, 14], plain) != together, "the options reach the draws"


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("top_p,top_k,min_p", [(1.0, 3, 0.0), (1.0, 0, 0.3), (0.85, 4, 0.2)])
def test_draws_keyed_by_token_id_follow_the_rule(backend, top_p, top_k, min_p):
    """Top-k or min-p on, the race is keyed by token id: 20,000 streams drawing from
    p = (0.4, 0.25, 0.2, 0.1, 0.05) draw the three kept tokens (top-k 3; min-p 0.3 keeps
    p >= 0.12; top-p 0.85 of the 4 first's mass 0.95 cuts before the fourth, 0.85 of mass
    before it, which min-p 0.2, p >= 0.08, would keep) each within 5 standard deviations of its
    renormalised probability, and never a dropped one."""
    probs = [0.4, 0.25, 0.2, 0.1, 0.05]
    draws = 20000
    logits = torch.tensor([probs]).log().expand(draws, -1).contiguous()
    seeds, positions = torch.arange(draws), torch.zeros(draws, dtype=torch.long)
    options = dict(greedy=False, backend=backend, top_k=top_k, min_p=min_p)
    tokens = sample_tokens(logits, seeds, positions, 1.0, top_p, **options)
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert counts[3] == counts[4] == 0, counts
    for token in range(3):
        p = probs[token] / sum(probs[:3])
        assert abs(counts[token] - draws * p) < 5 * math.sqrt(draws * p * (1 - p)), counts
