"""``DecodeGraphs`` on the CPU: the engine's decode passes captured and replayed by the graph
runtime stand-in of ``cuda_emulation`` (a replay re-runs the captured operations on the static
buffers) sample exactly what eager decode samples, over bucket changes, forks, copy-on-write,
trees and preemption; padded rows write the scratch slot only and restart from position 0 on
the scratch block; capture and replay run on the storage's device.

What CUDA runs, on the CPU: bf16 weights and KV cache (the C++ CPU kernels are pybind calls the
stand-in cannot record, and bf16 takes none of them) and the torch sampler. Paged attention: the
Triton kernel, whose loop ends at each row's length, so that a graph's full-width block tables
cost and round as an eager pass's narrower ones, in one scenario (the interpreter takes about a
second a launch); the torch reference in the others, which gathers and masks the whole table,
so SDPA's bf16 rounding depends on the table's width: both engines there get tables as wide as
the graphs' (``FullWidthTables``).
"""

from __future__ import annotations

import pytest
import torch
from cuda_emulation import EmulatedCuda

from rlvr_fast.engine import RolloutEngine, SamplingParams, model_runner
from rlvr_fast.engine.cuda_graphs import POSITIONS, SLOTS, DecodeGraphs
from rlvr_fast.engine.model_runner import DecodeInputs
from rlvr_fast.engine.token_sampler import sample_tokens
from rlvr_fast.models.checkpoint import load_model

EOS = 0
BLOCK_SIZE, MAX_BATCH, MAX_MODEL_LEN = 4, 8, 96
PROMPTS = [[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13, 14, 15, 16, 17], [18], [20, 21, 22]]
PARAMS = {"greedy": SamplingParams.greedy(12), "sampled": SamplingParams(max_new_tokens=12)}


@pytest.fixture(scope="module")
def model(hf_qwen3):
    return load_model(hf_qwen3[1], dtype=torch.bfloat16)


TABLE_WIDTH = -(-MAX_MODEL_LEN // BLOCK_SIZE)


class FullWidthTables:
    """The engine's block manager, its block tables padded to the graphs' width."""

    def __init__(self, manager) -> None:
        self.manager = manager

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def block_tables(self, block_ids, pad: int) -> torch.Tensor:
        tables = self.manager.block_tables(block_ids, pad)
        return torch.nn.functional.pad(tables, (0, TABLE_WIDTH - tables.shape[1]), value=pad)


def make_engine(model, graphs: bool, backend: str = "torch", **settings) -> RolloutEngine:
    settings.setdefault("kv_blocks", 256)
    engine = RolloutEngine(
        model,
        block_size=BLOCK_SIZE,
        max_batch=MAX_BATCH,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=[EOS],
        cuda_graphs=False,
        **settings,
    )
    engine.runner.backend, engine.runner.sampler = backend, "torch"
    if backend == "torch":
        engine.runner.manager = FullWidthTables(engine.manager)
    if graphs:
        engine.runner.graphs = DecodeGraphs(
            model,
            engine.storage,
            backend,
            max_batch=MAX_BATCH,
            table_width=TABLE_WIDTH,
            cuda=EmulatedCuda(),
        )
    return engine


def flat_runs(engine: RolloutEngine, params: SamplingParams) -> list[list[int]]:
    """Batches of 1, 3, 5 and 8 rows whose caps differ, so rows leave and buckets shrink."""
    completions = []
    for count in (1, 3, 5, 8):
        seqs = [
            engine.add(PROMPTS[i % len(PROMPTS)], seed=100 * count + i, max_new_tokens=3 + 2 * i)
            for i in range(count)
        ]
        engine.run(seqs, params)
        completions += [seq.completion for seq in seqs]
    return completions


def forked_runs(engine: RolloutEngine, params: SamplingParams) -> list[list[int]]:
    """A 6-token prompt forked 4 ways (its partial last block is copied on write), then a
    finished row forked mid-sequence (a partial block again)."""
    prompt = engine.add(PROMPTS[0])
    rows = engine.fork(prompt, n=4, seeds=[1, 2, 3, 4])
    engine.free(prompt)
    engine.run(rows, params)
    keep = engine.add(PROMPTS[2], seed=9, keep_cache=True)
    engine.run([keep], params)
    branches = engine.fork(keep, len(PROMPTS[2]) + 2, n=3, seeds=[5, 6, 7])
    engine.free(keep)
    engine.run(branches, params)
    return [seq.completion for seq in rows + branches]


def tree_runs(
    engine: RolloutEngine,
    params: SamplingParams,
    root_count: int = 3,
    root_tokens: int = 5,
    fork_after: int = 3,
) -> list[list[int]]:
    """Two stages as the tree planner runs them: K roots kept in the cache, each forked B = 2
    times after its ``fork_after``-th generated token, the branches run to their cap together."""
    stage_one = SamplingParams(max_new_tokens=root_tokens, temperature=params.temperature)
    roots = [engine.add(PROMPTS[k], seed=k, keep_cache=True) for k in range(root_count)]
    engine.run(roots, stage_one)
    branches = [
        branch
        for k, root in enumerate(roots)
        for branch in engine.fork(
            root, len(PROMPTS[k]) + fork_after, n=2, seeds=[10 * k, 10 * k + 1]
        )
    ]
    for root in roots:
        engine.free(root)
    engine.run(branches, params)
    return [root.completion for root in roots] + [branch.completion for branch in branches]


def preempted_runs(engine: RolloutEngine, params: SamplingParams) -> list[list[int]]:
    seqs = [engine.add(PROMPTS[i % len(PROMPTS)], seed=i, max_new_tokens=20) for i in range(6)]
    engine.run(seqs, params)
    return [seq.completion for seq in seqs]


SCENARIOS = {
    "buckets": (flat_runs, {}),
    "forks": (forked_runs, {}),
    "trees": (tree_runs, {}),
    "preemption": (preempted_runs, {"kv_blocks": 20}),
}


def run_both(model, scenario: str, params: SamplingParams):
    """The scenario on an eager engine and on a graphed one: (eager, graphed, their outputs)."""
    run, settings = SCENARIOS[scenario]
    eager, graphed = (make_engine(model, graphs, **settings) for graphs in (False, True))
    return eager, graphed, run(eager, params), run(graphed, params)


@pytest.mark.parametrize("mode", PARAMS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_graph_decode_samples_what_eager_decode_samples(model, scenario, mode):
    eager, graphed, expected, got = run_both(model, scenario, PARAMS[mode])
    assert got == expected
    graphs = graphed.runner.graphs.graphs
    assert graphs and all(graph.replays > 0 for graph, _ in graphs.values()), "graphs replayed"
    assert graphed.counters == eager.counters, "the same passes, copies and preemptions"
    for engine in (eager, graphed):
        engine.manager.check_invariants()
        assert engine.blocks_in_use == 0
    if scenario == "buckets":
        assert {bucket for bucket, _ in graphs} == {1, 2, 4, 8}
    if scenario in ("forks", "trees"):
        assert graphed.counters.block_copies > 0, "copy-on-write ran"
    if scenario == "preemption":
        assert graphed.counters.preemptions > 0


def test_graphs_replay_the_triton_decode_kernel_as_eager_decode_runs_it(model):
    """A small tree (2 roots of 3 tokens, forked inside a block after the first), sampled, on the
    Triton paged-attention kernel and the engine's own tables: the graphs launch the kernel once
    per layer and draw what eager decode draws (the interpreter takes about a second a launch)."""
    params = SamplingParams(max_new_tokens=2)
    eager, graphed = (make_engine(model, graphs, "triton") for graphs in (False, True))
    expected, got = (tree_runs(engine, params, 2, 3, 1) for engine in (eager, graphed))
    assert got == expected
    assert graphed.counters.block_copies > 0, "copy-on-write ran"
    for graph, _ in graphed.runner.graphs.graphs.values():
        kernels = graph.kernels()
        assert kernels.count("_paged_attention_kernel") == model.config.num_hidden_layers, kernels


def decode_inputs(rows: int, position: int) -> DecodeInputs:
    """Row r decodes token 7 + r at ``position`` in block r (one block per row)."""
    return DecodeInputs(
        token_ids=torch.arange(7, 7 + rows),
        positions=torch.full((rows,), position),
        slots=torch.arange(rows) * BLOCK_SIZE + position,
        block_tables=torch.arange(rows, dtype=torch.int32)[:, None],
        seeds=torch.arange(rows),
    )


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_graph_and_eager_decode_hand_the_sampler_the_same_logits(model, rows, monkeypatch):
    """One decode step of rows 33-47 tokens long (two 32-token tiles, a split's worth each) on
    the Triton kernel: eager decode with the engine's own tables (12 blocks wide, not padded) and
    the step a graph captures (B padded to its bucket, tables to max_model_len's 24 blocks) give
    the same logits bit for bit, the split count being the same for both."""
    engine = make_engine(model, graphs=True, backend="triton")
    storage, graphs, runner = engine.storage, engine.runner.graphs, engine.runner
    width = 12
    storage.reserve(rows * width)
    storage.data.normal_()
    positions = torch.tensor([33 + 2 * r for r in range(rows)])
    tables = torch.arange(rows * width, dtype=torch.int32).view(rows, width)
    inputs = DecodeInputs(
        token_ids=torch.arange(7, 7 + rows),
        positions=positions,
        slots=tables[torch.arange(rows), positions // BLOCK_SIZE].long() * BLOCK_SIZE
        + positions % BLOCK_SIZE,
        block_tables=tables,
        seeds=torch.arange(rows),
    )
    logits = []
    infer = model.infer

    def recorded(input_ids, context):
        logits.append(infer(input_ids, context))
        return logits[-1]

    monkeypatch.setattr(model, "infer", recorded)
    params = PARAMS["sampled"]
    bucket = next(b for b in graphs.buckets if b >= rows)
    with torch.inference_mode():
        runner.decode_eager(inputs, params)
        graphs._load(inputs, bucket, params)
        graphs._step(bucket, params.is_greedy)
    eager, graphed = logits
    assert graphs.block_tables.shape[1] == TABLE_WIDTH > width and graphed.shape[0] == bucket
    assert torch.equal(graphed[:rows], eager)


def written_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    changed = (before != after).flatten(start_dim=4).any(dim=-1).any(dim=0).any(dim=0)
    return set(torch.nonzero(changed.flatten()).flatten().tolist())


def test_padded_rows_write_the_scratch_slot_only_and_reset_positions_and_tables(model):
    """8 rows at position 3, then 5 rows at position 1 in the same bucket of 8: the 3 padding
    rows hold token 0 at position 0, the scratch block as their table and the scratch slot, and
    the replay writes the 5 live rows' slots and at most the scratch slot besides."""
    engine = make_engine(model, graphs=True, kv_blocks=16)
    storage, graphs = engine.storage, engine.runner.graphs
    storage.data.normal_()
    params = SamplingParams.greedy()
    with torch.inference_mode():
        graphs.run(decode_inputs(8, 3), params)
        before = storage.data.clone()
        graphs.run(decode_inputs(5, 1), params)
    padding = slice(5, 8)
    assert graphs.inputs[POSITIONS, padding].eq(0).all()
    assert graphs.inputs[SLOTS, padding].eq(storage.scratch_slot).all()
    assert graphs.block_tables[padding].eq(storage.scratch_block).all()
    live = {r * BLOCK_SIZE + 1 for r in range(5)}
    # The scratch slot may already hold token 0's keys at position 0 (the capture's warm-up).
    assert live <= written_slots(before, storage.data) <= live | {storage.scratch_slot}
    assert list(graphs.graphs) == [(8, True)], "one graph, replayed twice"


def test_capture_and_replay_run_on_the_storage_device(model):
    engine = make_engine(model, graphs=True)
    engine.run([engine.add(PROMPTS[0], seed=0)], PARAMS["sampled"])
    runtime = engine.runner.graphs.cuda
    assert runtime.capture_devices == [engine.storage.data.device]


def test_eager_decode_hands_the_sampler_what_the_graphs_hand_it(model, monkeypatch):
    """0-d tensors for temperature and top-p, in every eager draw too: CUDA divides by a Python
    float as a multiply by its reciprocal (ATen's div_true_kernel_cuda) and by a tensor exactly,
    which would let graph and eager decode draw apart; the CPU divides both ways exactly, so the
    scenarios above cannot see it."""
    kinds = []

    def spy(logits, seeds, positions, temperature, top_p, **kwargs):
        kinds.append((type(temperature), type(top_p)))
        return sample_tokens(logits, seeds, positions, temperature, top_p, **kwargs)

    monkeypatch.setattr(model_runner, "sample_tokens", spy)
    eager = make_engine(model, graphs=False)
    eager.run([eager.add(PROMPTS[0], seed=0)], PARAMS["sampled"])
    assert len(kinds) == PARAMS["sampled"].max_new_tokens
    assert set(kinds) == {(torch.Tensor, torch.Tensor)}
    graphs = make_engine(model, graphs=True).runner.graphs
    assert graphs.temperature.dim() == graphs.top_p.dim() == 0


def test_graphs_replay_top_k_and_min_p_and_a_penalty_decodes_eagerly(model):
    """top_k and min_p live in the graphs' 0-d buffers; the repetition penalty's history
    changes shape every step, so those decode passes run eagerly, drawing the same tokens."""
    filtered = SamplingParams(max_new_tokens=12, top_k=8, min_p=0.02)
    _, graphed, expected, got = run_both(model, "forks", filtered)
    assert got == expected and graphed.runner.graphs.graphs
    penalized = SamplingParams(max_new_tokens=12, repetition_penalty=1.3)
    _, graphed, expected, got = run_both(model, "forks", penalized)
    assert got == expected and not graphed.runner.graphs.graphs
    assert got != run_both(model, "forks", PARAMS["sampled"])[2], "the penalty is applied"
