"""What a sharded run holds on each rank beyond its shards (``rlvr_fast.train.sharding``), over 2
gloo ranks (``sharded_memory_check.py`` runs each rank; its docstring says what it measures):

- building the shards never holds a second full copy of the model;
- the engine's copy is refreshed one FSDP group at a time (one all-gather each), into the same
  storage, its transient about one group gathered plus its copy-out, in fp32 and bf16-mixed;
- a zero-gradient step that moves no weight publishes nothing (no gather); one that moves them
  (the first moment of an earlier step) does.

The peaks are resident sets (VmHWM), measured with glibc's mmap threshold fixed at 1 MiB so that
a freed tensor leaves the resident set (by default the threshold grows with the tensors freed,
and freed heap pages stay resident: the peak would be the allocator's, not the tensors')."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.test_distributed import child_env

MIB = 2**20


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    script = Path(__file__).with_name("sharded_memory_check.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(script)],
        env=child_env(MALLOC_MMAP_THRESHOLD_=str(MIB)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    return lines


def test_building_the_shards_holds_no_second_full_copy(ranks):
    for rank in ranks:
        startup = rank["startup"]
        assert startup["shards"] == startup["full"] // 2
        # This rank's shards, and FSDP's own first-use allocations (about 30 MiB here); a
        # copy of the model before sharding it would add the full 143 MB.
        assert startup["shards"] <= startup["rise"] < startup["shards"] + startup["full"] // 2


@pytest.mark.parametrize(
    ("precision", "dtype", "size"), [("fp32", "float32", 4), ("bf16-mixed", "bfloat16", 2)]
)
def test_the_engine_copy_is_refreshed_group_by_group_in_place(ranks, precision, dtype, size):
    for rank in ranks:
        refresh = rank[precision]
        assert refresh["engine_dtype"] == f"torch.{dtype}"
        assert refresh["equal"] and refresh["same_addresses"]
        assert refresh["all_gathers"] == 9, "8 decoder layers and the root, one all-gather each"
        # The largest group gathered in the compute dtype, and copied out of FSDP's buffer.
        group = rank["startup"]["largest_group"] // 4 * size
        assert refresh["rise"] <= 2 * group + 8 * MIB < rank["startup"]["full"] // 2


def test_a_zero_gradient_step_that_moves_no_weight_does_not_gather(ranks):
    for rank in ranks:
        publishes = rank["publishes"]
        assert publishes["first_left_the_shards"]
        assert publishes["refreshes_after_each_step"] == [0, 1, 2]
