"""One rank of a sharded ``rlvr-fast train`` that SIGKILLs itself at a named point (torchrun
then ends the other ranks, as a kill of the job would), whose disk fills, or that runs on
another device type than the others:

    torchrun --nproc-per-node 2 sharded_killed_run.py POINT N train ARGS...

POINT is where the run dies, on the N-th time (1-based) it gets there:
- ``step``: in a training step, every rank: the shards stepped and the engine's copy refreshed
  from them, the step's ledger line and checkpoint not written;
- ``shards``: in a checkpoint save, rank 0: every rank's shards written (DCP) into the staging
  directory, not yet renamed to ``checkpoint/shards-ID``;
- ``save``: in a checkpoint save, rank 0 (the writer): the shards renamed into place and the new
  state file naming them written whole to its temp name beside
  ``checkpoint/state.safetensors``, not yet renamed onto it;
- ``full``: rank 1's write of its shards fails with ENOSPC (no kill: the ranks exit as a full
  disk makes them);
- ``mixed``: rank 1 runs on CUDA (its ``--device`` taken as cuda, as on a node with GPUs), the
  others on the CPU (N unused).
"""

from __future__ import annotations

import errno
import os
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from rlvr_fast.cli import commands
from rlvr_fast.cli.main import main
from rlvr_fast.run import state_file
from rlvr_fast.train import sharding


def die_on_call(owner, name: str, times: int) -> None:
    """Replace ``owner.name`` with a function that runs it, and the ``times``-th time, once it
    has run, SIGKILLs this process."""
    original, calls = getattr(owner, name), [0]

    def dies(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == times:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, dies)


def fail_on_call(owner, name: str, times: int) -> None:
    """Make the ``times``-th call of ``owner.name`` fail as a full disk does."""
    original, calls = getattr(owner, name), [0]

    def fails(*args, **kwargs):
        calls[0] += 1
        if calls[0] == times:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(*args, **kwargs)

    setattr(owner, name, fails)


def run(point: str, times: int, argv: list[str]) -> int:
    if point == "step":
        # ShardedModel.refresh ends the step's optimizer update (the engine's copy gathered
        # from the stepped shards); the step's ledger line and checkpoint come after it.
        die_on_call(sharding.ShardedModel, "refresh", times)
    elif point == "shards":
        if os.environ.get("RANK") == "0":
            die_on_call(dcp, "save", times)
    elif point == "save":
        if os.environ.get("RANK") == "0":
            die_on_call(state_file, "save_file", times)
    elif point == "full":
        if os.environ.get("RANK") == "1":
            fail_on_call(FileSystemWriter, "write_data", times)
    elif point == "mixed":
        if os.environ.get("RANK") == "1":
            commands.parse_device = lambda text: torch.device("cuda")
    else:
        raise SystemExit(f"unknown kill point {point!r} (step, shards, save, full or mixed)")
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
