"""The rollout engine: logits against the full forward, fork semantics, continuous batching,
per-sequence streams, KV exhaustion (preempt and recompute, or a one-line error), and every block
given back after every run, an exception mid-run included."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.engine import FINISH_CAP, FINISH_EOS, OutOfBlocksError, RolloutEngine, SamplingParams
from rlvr_fast.engine import model_runner
from rlvr_fast.models.checkpoint import load_model

EOS = 0
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [17], [20, 21, 22]]


@pytest.fixture(scope="module")
def model(hf_qwen3):
    return load_model(hf_qwen3[1])


def make_engine(model, **settings) -> RolloutEngine:
    settings.setdefault("kv_blocks", 256)
    settings.setdefault("block_size", 4)
    settings.setdefault("eos_token_ids", [EOS])
    return RolloutEngine(model, **settings)


def all_free(engine: RolloutEngine) -> bool:
    engine.manager.check_invariants()
    return engine.blocks_in_use == 0


def full_forward_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0]


def test_prefill_and_every_decode_step_match_the_full_forward(model, monkeypatch):
    """Greedy rows of different prompt lengths, block size 4 (rows cross many block borders):
    the logits the engine draws from at every step equal the full forward's at that position."""
    seen: list[torch.Tensor] = []

    def spy(logits, *args, **kwargs):
        seen.append(logits.clone())
        return logits.argmax(dim=-1)

    monkeypatch.setattr(model_runner, "sample_tokens", spy)
    engine = make_engine(model, eos_token_ids=[])
    seqs = [engine.add(p) for p in PROMPTS]
    engine.run(seqs, SamplingParams.greedy(9))
    # Step 0 is one prefill of every row; steps 1.. decode every row (nobody stops early).
    assert len(seen) == 9 and all(s.shape[0] == len(PROMPTS) for s in seen)
    for row, seq in enumerate(seqs):
        expected = full_forward_logits(model, seq.token_ids)
        for step in range(9):
            position = len(PROMPTS[row]) - 1 + step
            torch.testing.assert_close(seen[step][row], expected[position], rtol=1e-4, atol=1e-5)
    assert all_free(engine)


def test_fork_shares_the_prompt_and_its_logits(model):
    engine = make_engine(model)
    prompt = engine.add(PROMPTS[2])
    rows = engine.fork(prompt, n=3)
    assert engine.counters.prefill_run == len(PROMPTS[2]), "the prompt ran once"
    torch.testing.assert_close(
        rows[0].logits, full_forward_logits(model, PROMPTS[2])[-1], rtol=1e-4, atol=1e-5
    )
    assert all(r.num_cached == len(PROMPTS[2]) and r.logits is prompt.logits for r in rows)
    engine.free(prompt)
    engine.run(rows, SamplingParams(max_new_tokens=6), generator=torch.Generator().manual_seed(0))
    assert engine.counters.prefill_run == len(PROMPTS[2]), "forks run no prefill"
    assert engine.counters.decode_rows == sum(r.num_generated - 1 for r in rows)
    assert all_free(engine)


def test_a_prefill_pass_admits_rows_by_padded_tokens(model, monkeypatch):
    """The runner pads every row of a pass to its widest, so the scheduler admits rows while
    their number times the widest stays within max_prefill_tokens: at 10, prompts of 7, 2, 2, 1
    and 3 tokens prefill as 7 alone (7 + 2 pending tokens fit 10, but 2 x 7 padded ones do not),
    then 2, 2, 1 (3 x 2), then 3, and each row draws what a single pass draws."""
    widths: list[tuple[int, int]] = []
    run_pass = model_runner.ModelRunner.prefill

    def counted(runner, batch):
        widths.append((len(batch.rows), max(seq.num_pending for seq in batch.rows)))
        return run_pass(runner, batch)

    prompts = [PROMPTS[2], PROMPTS[1], [30, 31], PROMPTS[3], PROMPTS[4]]
    whole = make_engine(model, eos_token_ids=[])
    expected = whole.run([whole.add(p) for p in prompts], SamplingParams.greedy(4))
    monkeypatch.setattr(model_runner.ModelRunner, "prefill", counted)
    engine = make_engine(model, eos_token_ids=[], max_prefill_tokens=10)
    got = engine.run([engine.add(p) for p in prompts], SamplingParams.greedy(4))
    assert widths == [(1, 7), (3, 2), (1, 3)]
    assert [seq.completion for seq in got] == [seq.completion for seq in expected]
    assert all_free(engine)


def test_extend_and_batched_prefill_give_the_full_forward_logits(model):
    """A shared prefix prefilled once, forked three times, each branch extended by its own
    question and all three prefilled in passes of at most 8 tokens: each next-token logits row
    equals the full forward of prefix + question; a sequence holding its logits costs nothing."""
    engine = make_engine(model, max_prefill_tokens=8)
    prefix = engine.add(PROMPTS[2])
    branches = engine.fork(prefix, n=3)
    engine.free(prefix)
    questions = [[30, 31, 32], [40], [50, 51, 52, 53, 54]]
    for branch, question in zip(branches, questions):
        engine.extend(branch, question)
    before = engine.counters.prefill_run
    logits = engine.prefill(branches)
    assert engine.counters.prefill_run - before == sum(map(len, questions)), "suffixes only"
    for row, question in enumerate(questions):
        expected = full_forward_logits(model, PROMPTS[2] + question)[-1]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-5)
        assert branches[row].completion == [] and branches[row].holds_logits
    assert torch.equal(engine.prefill(branches[:1]), logits[:1])
    assert engine.counters.prefill_run - before == sum(map(len, questions))
    engine.run(branches, SamplingParams.greedy(3))
    assert [b.completion[0] for b in branches] == logits.argmax(-1).tolist()
    assert all_free(engine)


def test_a_prefix_fork_of_a_finished_sequence_decodes_its_last_token(model, monkeypatch):
    """Fork a finished, cached sequence at a shorter length: the branch shares all but the
    prefix's last token, runs that token as one decode row, and draws from the same logits a
    fresh prefill of the prefix gives."""
    engine = make_engine(model, eos_token_ids=[])
    root = engine.add(PROMPTS[0], keep_cache=True)
    engine.run([root], SamplingParams.greedy(7))
    prefill_before = engine.counters.prefill_run
    seen = []
    monkeypatch.setattr(
        model_runner,
        "sample_tokens",
        lambda logits, *a, **k: seen.append(logits.clone()) or logits.argmax(-1),
    )
    cut = len(PROMPTS[0]) + 3
    (branch,) = engine.fork(root, cut)
    assert branch.num_cached == cut - 1 and branch.token_ids == root.token_ids[:cut]
    engine.free(root)
    engine.run([branch], SamplingParams.greedy(1))
    assert engine.counters.prefill_run == prefill_before
    torch.testing.assert_close(
        seen[0][0], full_forward_logits(model, root.token_ids[:cut])[-1], rtol=1e-4, atol=1e-5
    )
    assert branch.completion == [root.token_ids[cut]], "greedy: the root's own next token"
    assert all_free(engine)


def test_a_sequence_samples_the_same_tokens_alone_and_in_a_continuous_batch(model):
    """Seeded sampling: one sequence alone, then the same sequence among 11 others with room
    for 4 at a time (the rest wait and are admitted as rows finish)."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95)
    alone_engine = make_engine(model)
    alone = alone_engine.add(PROMPTS[0], seed=1234)
    alone_engine.run([alone], params)
    engine = make_engine(model, max_batch=4)
    others = [engine.add(PROMPTS[i % len(PROMPTS)], seed=i) for i in range(11)]
    same = engine.add(PROMPTS[0], seed=1234)
    finished = []
    engine.run(others[:7] + [same] + others[7:], params, on_finish=finished.append)
    assert same.completion == alone.completion
    assert len(finished) == 12 and finished != others[:7] + [same] + others[7:], (
        "rows finish in their own order"
    )
    assert all_free(engine) and all_free(alone_engine)


def test_unseeded_runs_repeat_with_the_same_generator(model):
    params = SamplingParams(max_new_tokens=10)

    def run(seed):
        engine = make_engine(model)
        seqs = [engine.add(p) for p in PROMPTS]
        engine.run(seqs, params, generator=torch.Generator().manual_seed(seed))
        return [s.completion for s in seqs]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_eos_and_cap_finish_rows(model):
    engine = make_engine(model, eos_token_ids=[])
    free = [engine.add(p) for p in PROMPTS]
    engine.run(free, SamplingParams.greedy(12))
    eos = free[0].completion[3]
    engine = make_engine(model, eos_token_ids=[eos])
    seqs = [engine.add(p) for p in PROMPTS]
    engine.run(seqs, SamplingParams.greedy(12))
    for seq, reference in zip(seqs, free):
        cut = reference.completion.index(eos) + 1 if eos in reference.completion else 12
        assert seq.completion == reference.completion[:cut]
        assert seq.finish_reason == (FINISH_EOS if eos in reference.completion else FINISH_CAP)
    assert seqs[0].finish_reason == FINISH_EOS
    assert engine.counters.decode_rows == sum(s.num_generated - 1 for s in seqs), (
        "no decode after a row finishes"
    )


def test_a_full_cache_preempts_and_recomputes(model):
    """Room for about two sequences: the others are preempted, recomputed later, and every
    sequence ends with what an unconstrained engine samples."""
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=1.0)
    big = make_engine(model)
    reference = [big.add(p, seed=i) for i, p in enumerate(PROMPTS)]
    big.run(reference, params)
    small = make_engine(model, kv_blocks=14)
    seqs = [small.add(p, seed=i) for i, p in enumerate(PROMPTS)]
    small.run(seqs, params)
    assert small.counters.preemptions > 0
    assert [s.completion for s in seqs] == [s.completion for s in reference]
    assert all_free(small)


def test_a_sequence_that_cannot_fit_is_a_clear_error_and_frees_everything(model):
    engine = make_engine(model, kv_blocks=3, eos_token_ids=[])
    seqs = [engine.add(PROMPTS[0]), engine.add(PROMPTS[1])]
    with pytest.raises(OutOfBlocksError, match="out of KV blocks: a sequence of .* tokens needs"):
        engine.run(seqs, SamplingParams.greedy(30))
    assert all_free(engine)
    with pytest.raises(OutOfBlocksError, match="raise kv_blocks"):
        engine.fork(engine.add(list(range(1, 20))))
    assert all_free(engine)


def test_an_exception_mid_run_gives_every_block_back(model):
    engine = make_engine(model)
    prompt = engine.add(PROMPTS[2])
    rows = engine.fork(prompt, n=4, keep_cache=True)
    engine.free(prompt)

    def explode(seq):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.run(rows, SamplingParams(max_new_tokens=8), on_finish=explode)
    assert all_free(engine)
    assert not engine.scheduler.has_work
    again = [engine.add(p) for p in PROMPTS]
    engine.run(again, SamplingParams.greedy(4))
    assert all_free(engine), "the engine is usable after the error"


def test_run_and_fork_refuse_misuse(model):
    engine = make_engine(model)
    seq = engine.add(PROMPTS[0])
    engine.run([seq], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="must be new"):
        engine.run([seq], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="num_tokens"):
        engine.fork(seq, len(seq.token_ids) + 1)
    with pytest.raises(ValueError, match="2 seeds needed"):
        engine.fork(seq, n=2, seeds=[1])
    with pytest.raises(ValueError, match="needs at least one token"):
        engine.add([])
    with pytest.raises(ValueError, match="token ids must lie in"):
        engine.add([211])


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(kv_blocks=0), "kv_blocks"),
        (dict(kv_memory_fraction=0.0), "kv_memory_fraction"),
        (dict(block_size=12), "power of two"),
        (dict(max_batch=0), "max_batch"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
    ],
)
def test_bad_engine_settings_are_refused(model, settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutEngine(model, **settings)


def test_the_cache_is_sized_once_from_a_budget(model):
    engine = RolloutEngine(model, max_batch=3, max_model_len=40, block_size=8)
    assert engine.num_blocks == 3 * (5 + 1), "at most what max_batch full-length rows hold"
    assert engine.storage.capacity <= engine.num_blocks, "the CPU storage grows with the need"
    assert engine.storage.data.shape[2] == engine.storage.capacity + 1, "plus the scratch block"


@pytest.mark.cuda
@pytest.mark.parametrize("greedy", [True, False])
def test_cuda_graph_decode_samples_what_eager_decode_samples(hf_qwen3, greedy):
    """bf16 on the GPU: graphs captured per batch bucket replay the eager pass, so the same
    seeds give the same tokens; batches of 1, 3 and 5 rows exercise padded buckets."""
    model = load_model(hf_qwen3[1], device="cuda", dtype=torch.bfloat16)
    params = SamplingParams.greedy(24) if greedy else SamplingParams(max_new_tokens=24)
    outputs = []
    for graphs in (False, True):
        engine = RolloutEngine(
            model, eos_token_ids=[EOS], kv_blocks=512, cuda_graphs=graphs, max_batch=8
        )
        runs = []
        for count in (1, 3, 5):
            seqs = [engine.add(PROMPTS[i % len(PROMPTS)], seed=i) for i in range(count)]
            engine.run(seqs, params)
            runs.append([s.completion for s in seqs])
        assert all_free(engine)
        outputs.append(runs)
    assert outputs[0] == outputs[1]
