"""What a CUDA graph captures makes no host sync: the decode step (model pass and draw) runs under
``no_host_sync``, which fails on scalar reads and data-dependent sizes, for every bucket, greedy
and sampled, on both paged-attention backends a graph may hold. The guard itself is checked to
catch each kind of sync, so the test can fail."""

from __future__ import annotations

import pytest
import torch
from cuda_emulation import HostSyncError, no_host_sync

from rlvr_fast.engine import RolloutEngine
from rlvr_fast.engine.cuda_graphs import DecodeGraphs
from rlvr_fast.models.checkpoint import load_model

MAX_BATCH = 4


@pytest.fixture(scope="module")
def model(hf_qwen3):
    return load_model(hf_qwen3[1], dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("greedy", [True, False])
def test_the_decode_step_makes_no_host_sync(model, backend, greedy):
    engine = RolloutEngine(
        model, kv_blocks=32, block_size=4, max_batch=MAX_BATCH, cuda_graphs=False
    )
    graphs = DecodeGraphs(model, engine.storage, backend, max_batch=MAX_BATCH, table_width=8)
    graphs.inputs[1].fill_(5)  # positions: every row attends to 6 slots
    with torch.inference_mode():
        for bucket in graphs.buckets:
            graphs._step(bucket, greedy)  # warm the caches a capture's warm-up fills
            with no_host_sync():
                tokens = graphs._step(bucket, greedy)
            assert tokens.shape == (bucket,)


SYNCS = {
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x.sum() > 0),
    "tolist": lambda x: x.tolist(),
    "nonzero": lambda x: torch.nonzero(x),
    "masked_select": lambda x: x.masked_select(x > 0),
    "unique": lambda x: torch.unique(x),
    "boolean index": lambda x: x[x > 0],
    "repeat_interleave": lambda x: torch.repeat_interleave(torch.tensor([1, 2])),
}


@pytest.mark.parametrize("name", SYNCS)
def test_the_guard_catches_every_kind_of_host_sync(name):
    x = torch.randn(6)
    with pytest.raises(HostSyncError), no_host_sync():
        SYNCS[name](x)


def test_the_guard_lets_device_side_work_through():
    x = torch.randn(6)
    with no_host_sync():
        out = torch.where(x > 0, x, 0.0).sort().values.cumsum(0)
        torch.repeat_interleave(torch.tensor([1, 2]), 2)
    assert out.shape == (6,)
