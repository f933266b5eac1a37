"""Sampler: the study's top-p semantics, reproducibility, EOS handling and ledger counts."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_fast.engine.sampler import SamplingParams, generate, next_tokens, top_p_probs
from rlvr_fast.models.checkpoint import load_model

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [17], [20, 21, 22]]


@pytest.fixture(scope="module")
def model(hf_qwen3):
    return load_model(hf_qwen3[1])


def seed_reference_filter(probs: list[float], top_p: float) -> dict[int, float]:
    """The study's rule written out in plain Python: sort descending, keep a token while the
    cumulative probability before it is < top_p, always keep the first, renormalise."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, before = [], 0.0
    for rank, token in enumerate(order):
        if rank == 0 or before < top_p:
            kept.append(token)
        before += probs[token]
    total = sum(probs[t] for t in kept)
    return {t: probs[t] / total for t in kept}


@pytest.mark.parametrize("top_p,kept", [(0.9, {0, 1, 2}), (0.5, {0}), (0.51, {0, 1}),
                                        (1e-6, {0}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_tokens_while_mass_before_is_below_top_p(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([probs]).log()
    filtered, ids = top_p_probs(logits, 1.0, top_p)
    got = {int(t): float(p) for t, p in zip(ids[0], filtered[0]) if p > 0}
    expected = seed_reference_filter(probs, top_p)
    assert set(got) == kept == set(expected)
    for token, p in expected.items():
        assert math.isclose(got[token], p, rel_tol=1e-6)


def test_temperature_is_applied_before_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    filtered, ids = top_p_probs(logits, 0.5, 0.9)
    sharpened = torch.softmax(logits / 0.5, dim=-1)[0].tolist()
    expected = seed_reference_filter(sharpened, 0.9)
    got = {int(t): float(p) for t, p in zip(ids[0], filtered[0]) if p > 0}
    assert got.keys() == expected.keys()
    assert all(math.isclose(got[t], expected[t], rel_tol=1e-5) for t in got)


def test_draws_follow_the_filtered_distribution():
    probs = [0.4, 0.25, 0.2, 0.1, 0.05]
    logits = torch.tensor([probs]).log().expand(20000, -1)
    draws = next_tokens(logits, SamplingParams(temperature=1.0, top_p=0.8),
                        torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=5).tolist()
    expected = seed_reference_filter(probs, 0.8)
    assert counts[3] == counts[4] == 0
    for token, p in expected.items():
        sd = math.sqrt(20000 * p * (1 - p))
        assert abs(counts[token] - 20000 * p) < 5 * sd


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    assert torch.equal(next_tokens(logits, SamplingParams.greedy(), None), logits.argmax(-1))


def test_same_generator_seed_reproduces_the_run(model):
    params = SamplingParams(max_new_tokens=24)
    runs = [generate(model, PROMPTS, params, eos_token_ids=[0],
                     generator=torch.Generator().manual_seed(seed)).tokens for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def first_eos_trim(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def test_eos_rows_leave_and_other_rows_are_unchanged(model):
    cap = 30
    free = generate(model, PROMPTS, SamplingParams.greedy(cap), eos_token_ids=[-1])
    assert free.finish_reasons == ["cap"] * len(PROMPTS)
    assert free.lengths == [cap] * len(PROMPTS)
    # Choose EOS ids that rows emit at different times, so rows leave the batch one by one.
    eos = {free.tokens[0][3], free.tokens[2][10]}
    out = generate(model, PROMPTS, SamplingParams.greedy(cap), eos_token_ids=sorted(eos))
    for row, tokens in enumerate(free.tokens):
        trimmed = first_eos_trim(tokens, eos)
        assert out.tokens[row] == trimmed
        assert out.lengths[row] == len(trimmed)
        assert out.finish_reasons[row] == ("eos" if trimmed[-1] in eos else "cap")
    assert out.finish_reasons[0] == "eos"
    # Each generated token after the first costs exactly one decode row-step: no work after EOS.
    assert out.decode_tokens == sum(n - 1 for n in out.lengths)
    assert out.decode_steps == max(out.lengths) - 1
    assert out.generated_tokens == sum(out.lengths)
    assert out.prefill_tokens == sum(map(len, PROMPTS))
    assert out.padded_prefill_tokens == len(PROMPTS) * max(map(len, PROMPTS))


def test_batched_greedy_equals_one_prompt_at_a_time(model):
    batched = generate(model, PROMPTS, SamplingParams.greedy(16), eos_token_ids=[0])
    for prompt, tokens in zip(PROMPTS, batched.tokens):
        alone = generate(model, [prompt], SamplingParams.greedy(16), eos_token_ids=[0])
        assert alone.tokens[0] == tokens


def test_immediate_eos_costs_no_decode(model):
    first = generate(model, PROMPTS[:1], SamplingParams.greedy(5), eos_token_ids=[-1]).tokens[0][0]
    out = generate(model, PROMPTS[:1], SamplingParams.greedy(5), eos_token_ids=[first])
    assert out.tokens == [[first]] and out.finish_reasons == ["eos"]
    assert out.decode_tokens == out.decode_steps == 0


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_empty_prompts_are_refused(model):
    with pytest.raises(ValueError, match="no prompts"):
        generate(model, [], SamplingParams(), eos_token_ids=[0])
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], SamplingParams(), eos_token_ids=[0])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40), SamplingParams.greedy(40)])
def test_paged_cache_samples_the_same_tokens(model, params, block_size):
    free = generate(model, PROMPTS, SamplingParams.greedy(40), eos_token_ids=[-1])
    eos = [free.tokens[0][3], free.tokens[2][10]]  # rows leave the batch at different steps
    contiguous = generate(model, PROMPTS, params, eos_token_ids=eos,
                          generator=torch.Generator().manual_seed(5))
    paged = generate(model, PROMPTS, params, eos_token_ids=eos,
                     generator=torch.Generator().manual_seed(5), paged=True,
                     block_size=block_size)
    assert paged.tokens == contiguous.tokens
    assert paged.finish_reasons == contiguous.finish_reasons
    assert (paged.decode_tokens, paged.generated_tokens, paged.prefill_tokens) == \
        (contiguous.decode_tokens, contiguous.generated_tokens, contiguous.prefill_tokens)
    # Peak blocks: every row's prompt plus what it generated; rows that finished early had
    # already given theirs back.
    longest = max(map(len, PROMPTS)) + 40
    assert paged.peak_kv_blocks <= len(PROMPTS) * -(-longest // block_size)
    assert contiguous.peak_kv_blocks is None


def test_paged_sequences_branch_a_running_sequence(model):
    """Fork a sequence mid-decode at full length and at a shorter prefix: each branch's next
    logits equal a fresh prefill of the same tokens, the fork itself runs no prefill, and
    freeing everything returns every block."""
    from rlvr_fast.engine.paged_kv import PagedSequences

    seqs = PagedSequences(model, 32, block_size=4)
    prompt, generated = [5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16]
    root = seqs.new()
    seqs.prefill([root], [prompt])
    for token in generated[:-1]:
        seqs.decode([root], [token])
    prefill_before = seqs.prefill_tokens
    whole = seqs.fork(root)
    prefix = seqs.fork(root, len(prompt) + 2)
    assert seqs.prefill_tokens == prefill_before, "forking runs no prefill"
    branch_logits = seqs.decode([whole, prefix], [generated[-1], generated[2]])
    assert seqs.block_copies <= 2, "at most one block copy per branch"
    fresh = seqs.new()
    fresh_logits = seqs.prefill([fresh], [prompt + generated])
    torch.testing.assert_close(branch_logits[0], fresh_logits[0], rtol=1e-4, atol=1e-5)
    short = seqs.new()
    short_logits = seqs.prefill([short], [prompt + generated[:3]])
    torch.testing.assert_close(branch_logits[1], short_logits[0], rtol=1e-4, atol=1e-5)
    for seq in (root, whole, prefix, fresh, short):
        seqs.free(seq)
    assert seqs.manager.num_free_blocks() == seqs.manager.num_blocks
    seqs.manager.check_invariants()


@pytest.mark.parametrize("path", ["triton", "gather"])
def test_attention_paths_of_the_paged_caches_agree(model, path):
    """The C++ CPU kernel (float32, the default on CPU) against the other two paths: the
    Triton kernels (on CUDA when there is one, else on CPU under TRITON_INTERPRET=1; power-of-two
    block tables) and the torch gather with key masks (other dtypes: a float64 copy of the
    model). Prefill, decode, a prefix fork with a suffix prefill, and a batched decode."""
    import copy

    from rlvr_fast.engine.paged_kv import PagedSequences

    logits = []
    for other in (False, True):
        candidate = copy.deepcopy(model)
        if other and path == "triton" and torch.cuda.is_available():
            candidate = candidate.to("cuda")
        if other and path == "gather":
            candidate = candidate.double()
        seqs = PagedSequences(candidate, 32, block_size=4)
        seqs.storage.use_triton = other and path == "triton"
        root = seqs.new()
        out = [seqs.prefill([root], [[5, 6, 7, 8, 9]])]
        out.append(seqs.decode([root], [11]))
        branch = seqs.fork(root, 4)
        out.append(seqs.prefill([branch, seqs.new()], [[9, 12, 13], [3]]))
        out.append(seqs.decode([root, branch], [14, 15]))
        logits.append(torch.cat(out).cpu().float())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
