"""The KV cache on the CPU is sized by the run's need, a request that cannot fit is one line
naming the setting, and fork is all-or-nothing (issue 28, item 9): the tiny model's engine used
to reserve 2.1 GB, an address-space limit or a huge max_batch ended in allocator tracebacks, and
fork(s, n=10**7) left 6.7 million sequences registered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr_fast.engine import OutOfBlocksError, RolloutEngine, SamplingParams
from rlvr_fast.engine import engine as engine_module
from rlvr_fast.engine import kv_storage
from rlvr_fast.engine.kv_storage import bytes_per_block
from rlvr_fast.engine.memory import plan_engine, prefill_bytes
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.policy import load_policy

PROMPT = list(range(1, 30))
CONFIGS = Path(engine_module.__file__).parents[1] / "assets" / "configs"


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


def run_group(engine, rows=8, tokens=48, seed=0):
    seq = engine.add(PROMPT)
    group = engine.fork(seq, n=rows)
    engine.free(seq)
    engine.run(
        group, SamplingParams(max_new_tokens=tokens), generator=torch.Generator().manual_seed(seed)
    )
    return [row.completion for row in group]


def test_the_cpu_cache_holds_what_the_run_uses_not_a_share_of_memory(tiny):
    """Regression: 2.1 GB reserved for the 886k-parameter model (max_batch x max_model_len)."""
    engine = RolloutEngine.for_policy(tiny)
    assert engine.storage.data.nbytes < 4 << 20
    run_group(engine, rows=16, tokens=200)
    peak = engine.counters.peak_kv_blocks
    assert peak <= engine.storage.capacity <= max(2 * peak, kv_storage.INITIAL_CPU_BLOCKS)


def test_a_cache_that_grows_mid_run_samples_what_a_full_one_samples(tiny, monkeypatch):
    """Growth copies every block it holds: the same seeds give the same tokens as a storage
    that held every block from the start."""
    monkeypatch.setattr(kv_storage, "INITIAL_CPU_BLOCKS", 1 << 20)
    full = RolloutEngine.for_policy(tiny, kv_blocks=512)
    assert full.storage.capacity == 512
    monkeypatch.setattr(kv_storage, "INITIAL_CPU_BLOCKS", 1)
    growing = RolloutEngine.for_policy(tiny, kv_blocks=512)
    assert run_group(growing, rows=12, tokens=96) == run_group(full, rows=12, tokens=96)
    assert 1 < growing.storage.capacity <= 512


def test_an_engine_made_without_kv_blocks_is_sized_by_its_plan(tiny, monkeypatch):
    """Every engine, in the trainer or not, takes its KV cache from its own plan: its working
    sets come off the free memory first, then kv_memory_fraction of the rest; too little is one
    line naming the largest term."""
    monkeypatch.setattr(engine_module, "free_memory", lambda device: 64 << 20)
    engine = RolloutEngine.for_policy(tiny, max_batch=16, kv_memory_fraction=0.5)
    plan = engine.plan
    assert [term.name for term in plan.terms] == ["prefill pass"], "CPU: no graphs, flash fp32"
    block = engine.storage.block_bytes
    assert plan.left == (64 << 20) - plan.fixed_bytes
    assert engine.manager.num_blocks == min(int(plan.left * 0.5) // block, 16 * (64 + 1))
    monkeypatch.setattr(engine_module, "free_memory", lambda device: plan.fixed_bytes + block)
    with pytest.raises(OutOfBlocksError, match="the largest is prefill pass") as err:
        RolloutEngine.for_policy(tiny, max_batch=16, kv_memory_fraction=0.5)
    assert "\n" not in str(err.value)


def test_the_engine_plan_on_a_gpu_counts_the_graph_pool_and_fp32_attention_scores():
    """Qwen3-0.6B on an 80 GB card's free memory: bf16 takes the flash kernel, fp32 falls back to
    SDPA's math path, whose scores for the largest prefill pass come off the KV cache's share: a
    16,384-token row alone (2 x 16 heads x 16,384^2 x 4 B, 34 GB), or with rows of at most 2,048
    tokens, four of them in one pass of 8,192 padded tokens (2 x 16 x 8,192 x 2,048 x 4 B)."""
    config = ModelConfig.from_file(CONFIGS / "qwen3-0.6b-base.json")
    common = dict(
        device_type="cuda",
        memory=80 << 30,
        fraction=0.5,
        most=10**9,
        max_batch=256,
        max_prefill_tokens=8192,
        max_model_len=16384,
        cuda_graphs=True,
    )
    plans = {
        e: plan_engine(config, element=e, block_bytes=bytes_per_block(config, 16, dtype), **common)
        for e, dtype in ((2, torch.bfloat16), (4, torch.float32))
    }
    names = {e: [term.name for term in plan.terms] for e, plan in plans.items()}
    assert names[2] == [
        "decode working set (CUDA-graph pool)",
        "prefill pass",
        "CUDA context, workspaces, allocator slack",
    ]
    scores = next(t for t in plans[4].terms if t.name.startswith("prefill attention scores"))
    assert scores.bytes == 2 * 16 * 16384**2 * 4
    assert plans[4].terms[1].bytes == prefill_bytes(config, 4, 16384, 256), "one row alone"
    short = plan_engine(config, element=4, block_bytes=1, **{**common, "max_model_len": 2048}).terms
    assert [t.bytes for t in short[1:3]] == [
        prefill_bytes(config, 4, 8192, 256),
        2 * 16 * 8192 * 2048 * 4,
    ]
    for e, plan in plans.items():
        assert plan.kv_blocks == int((80 << 30) - plan.fixed_bytes) // 2 // (
            bytes_per_block(config, 16, torch.bfloat16 if e == 2 else torch.float32)
        )


CONFINED = """
import resource, sys, torch
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.models.policy import load_policy
policy = load_policy("tiny")
engine = RolloutEngine.for_policy(policy, max_batch=int(sys.argv[2]), kv_blocks=1 << 17)
seq = engine.add(list(range(1, 30)))
rows = engine.fork(seq, n=int(sys.argv[3]))
engine.free(seq)
try:
    engine.run(rows, SamplingParams(max_new_tokens=int(sys.argv[4])), generator=torch.Generator())
    print("ran", engine.storage.capacity)
except ValueError as err:
    print("refused", err)
"""


def confined(limit_bytes: int, max_batch: int, rows: int, tokens: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CONFINED, *map(str, (limit_bytes, max_batch, rows, tokens))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


IMPORTS = """
import torch
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import load_policy
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")))
"""


def address_space_of_the_imports() -> int:
    """Bytes of address space a process has once it imported torch and the engine: 0.8 GB with
    a CPU build of torch, 3.3 GB with a CUDA build (torch 2.11 from PyPI, the GPU machine's),
    whose libraries map far more than they use."""
    done = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout) * 1024


def test_under_a_2_5_gb_address_limit_a_group_runs_and_a_huge_batch_is_one_line():
    """Regression: under a 2.5 GB address-space limit the run ended in an allocator traceback;
    with max_batch=65536 too. Now a group runs, and 65,536 rows (a 4 GiB cache of 2**17 blocks
    allowed) stop at the growth that finds no memory, with one line naming the settings. The
    limit is 1.7 GB past the imports' address space (2.5 GB in all with a CPU build of torch)."""
    limit = address_space_of_the_imports() + 1_700_000_000
    assert confined(limit, 65536, 8, 64).startswith("ran ")
    message = confined(limit, 65536, 65536, 4000)
    assert message.startswith("refused KV cache: no memory for ")
    assert "lower max_batch, or bound the cache with kv_blocks or kv_memory_fraction" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_batch=1 << 17), "max_batch must be in \\[1, 65,536\\], got 131,072"),
        (dict(max_model_len=1 << 40), "max_model_len must be in \\[1, 1,048,576\\]"),
        (dict(kv_blocks=10**12), "kv_blocks=1,000,000,000,000 needs .* GiB of KV cache, more than"),
    ],
)
def test_extreme_engine_settings_are_one_line_errors(tiny, settings, message):
    with pytest.raises(ValueError, match=message) as err:
        RolloutEngine.for_policy(tiny, **settings)
    assert "\n" not in str(err.value)


def test_a_fork_of_ten_million_is_refused_and_registers_nothing(tiny):
    """Regression: MemoryError after 6,682,827 sequences were registered (5.3 GB held)."""
    engine = RolloutEngine.for_policy(tiny)
    seq = engine.add(PROMPT, keep_cache=True)
    engine.prefill([seq])
    before = engine.manager.num_sequences
    with pytest.raises(ValueError, match="1 <= n <= 65,536, got num_tokens=29, n=10,000,000"):
        engine.fork(seq, n=10**7)
    assert engine.manager.num_sequences == before


class FailingFork:
    """The block manager, whose fork fails on its ``fail_at``-th call (out of memory)."""

    def __init__(self, manager, fail_at: int) -> None:
        self.manager, self.calls, self.fail_at = manager, 0, fail_at

    def fork(self, seq_id, num_tokens):
        self.calls += 1
        if self.calls == self.fail_at:
            raise MemoryError
        return self.manager.fork(seq_id, num_tokens)

    def __getattr__(self, name):
        return getattr(self.manager, name)


def test_a_fork_cut_short_leaves_nothing_registered(tiny, monkeypatch):
    engine = RolloutEngine.for_policy(tiny)
    seq = engine.add(PROMPT)
    engine.prefill([seq])
    before = (engine.manager.num_sequences, engine.manager.num_free_blocks())
    monkeypatch.setattr(engine, "manager", FailingFork(engine.manager, fail_at=6))
    with pytest.raises(MemoryError):
        engine.fork(seq, n=10)
    monkeypatch.undo()
    assert (engine.manager.num_sequences, engine.manager.num_free_blocks()) == before
    engine.manager.check_invariants()
