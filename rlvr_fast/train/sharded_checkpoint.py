"""A sharded run's trained weights, optimizer moments, Polyak sums and RNG states in
``torch.distributed.checkpoint`` (DCP), beside the run's state file: each rank writes its own
shards, nothing is gathered.

    checkpoint/state.safetensors         next step, identity, the other components, and
                                         "shards": {"directory": "shards-<id>", ...}
    checkpoint/shards-<id>/              DCP: .metadata and one __R_0.distcp a rank

The state file's entry lists the SHA-256 of every file of ``shards-<id>/`` ("files"), which
its own digest covers: a resume checks them all before it restores anything, and refuses a
shard file that is missing, truncated or changed, naming it (each rank hashes every W-th file,
at the save and at the load).

The trained weights are what the optimizer steps, by name (sharded: the shards, which under a
mixed precision are the fp32 masters; unsharded: the model's parameters or its fp32 masters),
and the moments are the optimizer's entries of a parameter's shape (AdamW's ``exp_avg``,
``exp_avg_sq``); its other entries (AdamW's ``step``) and parameter groups are small and ride in
the state file. The engine's compute-dtype copy is not saved: it is refreshed from the weights.
The Polyak sums are sums of the shards (``rlvr_fast.train.polyak``), sharded as the weights
are: each rank writes its own, and DCP reshards them at a resume (one process loads them whole). The run's generator and torch's RNG are the same on every rank (all draw the same
numbers): DCP writes one copy and every rank loads it.

Atomic: the ranks write into a staging directory (a temp name, which a resume's cleaning
removes), rank 0 renames it to ``shards-<id>`` and only then writes the state file naming it,
atomically; the directories it no longer names go after. A kill at any point leaves the
previous state file and the shards it names. DCP reshards on load, so a checkpoint resumes on
any number of ranks, sharded or not (one process loads whole tensors from it).
"""

from __future__ import annotations

import re
import secrets
import shutil
import warnings
from pathlib import Path

import torch

from rlvr_fast.run.state_file import StateFileError
from rlvr_fast.train import distributed
from rlvr_fast.train.sharding import whole_tensor
from rlvr_fast.utils.files import file_sha256, new_temp_directory, publish_staged_directory

# Components every rank holds the same state of (all ranks draw the same numbers): DCP writes
# one copy, which every rank loads.
REPLICATED = ("generator", "torch_rng")
SHARDS_PREFIX = "shards-"
SHARDS_NAME = re.compile(r"shards-[0-9a-f]{8}")
# A file of the shards' directory, as the state file lists it: a name, never a path.
SHARD_FILE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*")


class ShardedCheckpoint:
    """``stepping``'s (an ``OptimizerStepping``) trained weights and moments, and of
    ``components`` (the checkpoint's, by name) the Polyak sums and the RNG states, in DCP: the
    ``Checkpointer``'s shard store."""

    # The checkpoint components whose state the shards hold in place of the state file.
    covers = ("model", "optimizer", "masters", "polyak", *REPLICATED)

    def __init__(self, stepping, components: dict | None = None) -> None:
        self.stepping = stepping
        components = components or {}
        self.polyak = components.get("polyak")
        self.replicated = {n: components[n] for n in REPLICATED if components.get(n) is not None}

    def trained(self) -> dict[str, torch.Tensor]:
        """What the optimizer steps, by name, in the optimizer's order."""
        stepping = self.stepping
        if stepping.masters is not None:
            return dict(stepping.masters.named_parameters())
        return {n: p for n, p in stepping.model.named_parameters() if p.requires_grad}

    def save(self, checkpoint: Path) -> dict:
        """Write the shards beside ``checkpoint`` (the state file's path; every rank calls
        this) and return the state file's entry naming them."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        where = None
        if distributed.is_main():
            final = checkpoint.parent / f"{SHARDS_PREFIX}{secrets.token_hex(4)}"
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            where = (str(final), str(new_temp_directory(final)))
        final, staging = (Path(p) for p in distributed.all_gather(where)[0])
        trained = self.trained()
        names = list(trained)
        state = self.stepping.optimizer.state_dict()
        moments, small = {}, {}
        for index, entry in state["state"].items():
            name = names[index]
            param = trained[name]
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    moments.setdefault(name, {})[key] = value
                else:
                    small.setdefault(name, {})[key] = whole_tensor(value)
        weights = {name: param.detach() for name, param in trained.items()}
        shards = {
            "weights": weights,
            "moments": moments,
            "replicated": {name: c.state_dict() for name, c in self.replicated.items()},
        }
        if self.polyak is not None:
            shards["polyak"] = self.polyak_shards()
        try:
            dcp.save(shards, checkpoint_id=str(staging))
        except CheckpointException as err:
            # (the staging directory left goes at the resume; the previous checkpoint stands)
            raise OSError(
                f"{staging}: writing the checkpoint's shards failed: {first_failure(err)}"
            ) from None
        files = shard_digests(staging)
        if distributed.is_main():
            publish_staged_directory(staging, final)
        layout = {name: sorted(keys) for name, keys in moments.items()}
        return {
            "directory": final.name,
            "files": files,
            "moments": layout,
            "small": small,
            "param_groups": state["param_groups"],
            "polyak_count": self.polyak.count if self.polyak is not None else None,
        }

    def polyak_shards(self) -> dict:
        """This rank's shards of the Polyak sums (DTensors sharded as the weights are: each rank
        sums its own shards of them), by name: nothing is sent."""
        return dict(self.polyak.sums)

    def check(self, checkpoint: Path, entry: dict) -> None:
        """Refuse shards that ``entry`` (the state file's) does not name whole: a file missing,
        or its SHA-256 not the one recorded (every rank calls this; each hashes every W-th
        file)."""
        name = entry["directory"]
        if not isinstance(name, str) or SHARDS_NAME.fullmatch(name) is None:
            raise ValueError(f"its shards are named {name!r}, not shards-<8 hex digits>")
        directory = checkpoint.parent / name
        if not directory.is_dir() or directory.is_symlink():
            raise ValueError(f"its shards {name}/ are missing")
        files = entry.get("files")
        if not isinstance(files, dict) or not files:
            raise ValueError(f"its shards {name}/ carry no digests")
        names = sorted(files)
        damaged = []
        for file in names[distributed.rank() :: distributed.world_size()]:
            path = directory / file
            if not SHARD_FILE.fullmatch(file) or path.is_symlink() or not path.is_file():
                damaged.append(f"{name}/{file} is missing")
            elif file_sha256(path) != files[file]:
                damaged.append(f"{name}/{file} differs from the file the checkpoint wrote")
        damaged = sorted(d for found in distributed.all_gather(damaged) for d in found)
        if damaged:
            raise StateFileError(
                f"{checkpoint.parent}: {damaged[0]} (damaged, truncated or removed); resume "
                "from an intact checkpoint"
            )

    def load(self, checkpoint: Path, entry: dict) -> None:
        """Restore the weights and moments ``entry`` (the state file's) names, resharded onto
        this run's ranks, then the engine's copy from them."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        directory = checkpoint.parent / entry["directory"]  # (``check`` vetted it)
        trained = self.trained()
        unknown = sorted((set(entry["moments"]) | set(entry["small"])) - set(trained))
        if unknown:
            raise ValueError(f"optimizer state for {unknown[0]}, not a parameter of this run")
        weights = {name: param.detach() for name, param in trained.items()}
        moments = {
            name: {key: torch.empty_like(weights[name]) for key in keys}
            for name, keys in entry["moments"].items()
        }
        replicated = {name: c.state_dict().clone() for name, c in self.replicated.items()}
        shards = {"weights": weights, "moments": moments, "replicated": replicated}
        polyak_count = entry["polyak_count"]
        if (polyak_count is None) != (self.polyak is None):
            raise ValueError("its Polyak sums are not this run's")
        if self.polyak is not None:
            # (sharded, each rank's shards of the sums; one process, the whole sums)
            shards["polyak"] = self.polyak.sums
        try:
            with torch.no_grad(), warnings.catch_warnings():
                # One process loads whole tensors (DCP warns that it assumes so).
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load(shards, checkpoint_id=str(directory))
        except CheckpointException as err:
            raise ValueError(f"its shards do not load: {first_failure(err)}") from None
        for name, component in self.replicated.items():
            component.load_state_dict(replicated[name])
        if self.polyak is not None:
            self.polyak.count = int(polyak_count)
        index = {name: i for i, name in enumerate(trained)}
        optimizer_state = {
            index[name]: {**entry["small"].get(name, {}), **moments.get(name, {})}
            for name in trained
            if name in moments or name in entry["small"]
        }
        self.stepping.optimizer.load_state_dict(
            {"state": optimizer_state, "param_groups": entry["param_groups"]}
        )
        if self.stepping.sharded is not None:
            self.stepping.sharded.refresh()
        elif self.stepping.masters is not None:
            self.stepping.masters.publish()

    @staticmethod
    def remove_others(checkpoint: Path, kept: str | None) -> None:
        """Remove the shard directories beside ``checkpoint`` other than ``kept`` (older ones,
        and any a kill left unnamed between its rename and the state file's; None: all)."""
        for path in checkpoint.parent.glob(f"{SHARDS_PREFIX}*"):
            if path.name != kept and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


def shard_digests(directory: Path) -> dict[str, str]:
    """File name -> SHA-256 of every file in ``directory`` (written whole by every rank; a
    collective: rank 0 lists the files, each rank hashes every W-th of them)."""
    listed = None
    if distributed.is_main():
        listed = sorted(p.name for p in directory.iterdir() if p.is_file())
    names = distributed.all_gather(listed)[0]
    mine = {
        n: file_sha256(directory / n) for n in names[distributed.rank() :: distributed.world_size()]
    }
    return {n: d for part in distributed.all_gather(mine) for n, d in sorted(part.items())}


def first_failure(err) -> str:
    """A DCP ``CheckpointException`` in one line: its first failed rank and that rank's error."""
    rank, (exc, _) = min(err.failures.items())
    lines = str(exc).strip().splitlines()
    return f"rank {rank}: {type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
