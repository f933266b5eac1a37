"""Checkpoints of a run: the state of every checkpointed component in one safetensors state file
(``rlvr_fast.run.state_file``: no pickle), written atomically.

The trainer hands the ``Checkpointer`` its components by name (torchtitan's pattern): each has
``state_dict()`` / ``load_state_dict()``, and may have ``check_state(state)``, which runs for
every component before any is restored, so that a damaged or foreign file fails whole, not
steps later. A component given as None saves None and restores nothing.

A checkpoint proves where it comes from: beside the components it holds the run's identity
(``checkpoint_identity``: a hash of the settings, the seed, the precision, and in a run directory
the starting model, dtype, device, evaluation sets and training problems), checked, with the state file's digest
(``rlvr_fast.run.state_file``), before any component is restored: a damaged file, or one copied
from another run (another seed, an fp16-mixed run's into an fp32 one), is refused naming what
differs. A checkpoint written before identities (state format 1) is resumed with one warning line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Protocol

import torch

from rlvr_fast.run.state_file import StateFileError, read_state, save_state

IDENTITY_KEY = "run"
# The state file's entry naming a sharded run's shards (``rlvr_fast.train.sharded_checkpoint``).
SHARDS_KEY = "shards"


class Stateful(Protocol):
    def state_dict(self): ...

    def load_state_dict(self, state) -> None: ...


class GeneratorState:
    """A ``torch.Generator`` as a component (its state as a CPU byte tensor)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


class GlobalRNGState:
    """torch's default CPU generator as a component."""

    def state_dict(self) -> torch.Tensor:
        return torch.get_rng_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


# What a component's restore may raise on a file that is not a checkpoint of this run.
RESTORE_ERRORS = (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError)


def checkpoint_identity(settings_sha256: str, seed: int, precision: str, **more) -> dict:
    """What a checkpoint must share with the run that resumes from it (``more``: the starting
    model's hash, dtype, device and evaluation sets, where a run directory records them)."""
    return {"settings_sha256": settings_sha256, "seed": seed, "precision": precision, **more}


class Checkpointer:
    """Saves and restores ``components`` (name -> Stateful or None) with the step to continue
    from, at most ``steps``, the world size that wrote the file and the run's ``identity``."""

    def __init__(
        self, components: dict[str, Stateful | None], *, steps: int, identity: dict, shards=None
    ) -> None:
        self.components, self.steps, self.identity = components, steps, identity
        # The shard store (``rlvr_fast.train.sharded_checkpoint.ShardedCheckpoint``): writes the
        # components it ``covers`` as each rank's shards beside the state file, for a sharded
        # run, and restores them from a checkpoint that holds them so, for any run.
        self.shards = shards
        self.restored_shards = False
        # Entries of the identity a resume accepts by a rule, not equality (the training
        # problems, which an extended run may add to): key -> accepts(recorded value).
        self.accepts: dict[str, Callable[[object], bool]] = {}

    def state(
        self, next_step: int, world_size: int, *, sharded: bool = False, shards_at=None
    ) -> dict:
        """Every component's state (a sharded run's ranks all take it: its tensors are
        gathered), with the step to continue from, the world size and the run's identity; with
        ``shards_at`` (the state file's path) the covered components' go to the shard store
        there instead, each rank writing its own."""
        state = {"next_step": next_step, "world_size": world_size, IDENTITY_KEY: self.identity}
        if sharded:
            state["sharded"] = True
        covered = ()
        if shards_at is not None:
            state[SHARDS_KEY] = self.shards.save(shards_at)
            covered = self.shards.covers
        for name, component in self.components.items():
            if name not in covered:
                state[name] = component.state_dict() if component is not None else None
        return state

    def save(self, path: Path, next_step: int, world_size: int, state: dict | None = None) -> None:
        """The checkpoint at ``path``: ``state``, or (None) the components' state now; then the
        shards it does not name are removed."""
        state = state if state is not None else self.state(next_step, world_size)
        save_state(path, state)
        if self.shards is not None:
            kept = state.get(SHARDS_KEY)
            self.shards.remove_others(path, kept["directory"] if kept is not None else None)

    def load(self, path: Path, check_world_size: Callable[[int, Path, bool], None]) -> int:
        """Restore the checkpoint at ``path``; returns the step to continue from. State files
        load onto the CPU: Generator.set_state and torch.set_rng_state take CPU byte tensors (a
        CUDA generator's state too); load_state_dict copies weights and moments onto the
        parameters' device."""
        state, digested = read_state(path)
        if digested:
            self.check_identity(state.get(IDENTITY_KEY), path)
        else:
            print(
                f"rlvr-fast: warning: {path} was written before checkpoints carried a digest "
                "(state format 1); resuming without checking it",
                file=sys.stderr,
            )
        # A sharded run's file (whole tensors) may resume on another number of ranks.
        check_world_size(state.get("world_size", 1), path, state.get("sharded") is True)
        try:
            next_step = state["next_step"]
            if (
                isinstance(next_step, bool)
                or not isinstance(next_step, int)
                or not 0 <= next_step <= self.steps
            ):
                raise ValueError(f"next_step {next_step!r} is outside [0, {self.steps}]")
            shards = state.get(SHARDS_KEY)
            covered = self.shards.covers if shards is not None else ()
            if shards is not None:
                self.shards.check(path, shards)
            live = {
                name: c
                for name, c in self.components.items()
                if c is not None and name not in covered
            }
            for name, component in live.items():
                check = getattr(component, "check_state", None)
                if check is not None:
                    check(state[name])
            for name, component in live.items():
                component.load_state_dict(state[name])
            if shards is not None:
                self.shards.load(path, shards)
            self.restored_shards = shards is not None
        except StateFileError:
            raise
        except RESTORE_ERRORS as err:
            message = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise StateFileError(f"{path}: not a checkpoint of this run ({message})") from None
        return next_step

    def check_identity(self, recorded, path: Path) -> None:
        """Refuse a checkpoint of another run, naming the first thing that differs."""
        if not isinstance(recorded, dict):
            raise StateFileError(f"{path}: not a checkpoint of this run (no run identity)")
        # The named figures first; the settings' hash, which covers the seed too, last.
        for key in sorted(self.identity, key=lambda k: k == "settings_sha256"):
            expected = self.identity[key]
            accepts = self.accepts.get(key, lambda value, expected=expected: value == expected)
            if not accepts(recorded.get(key)):
                raise StateFileError(
                    f"{path}: a checkpoint of another run ({key} {short(recorded.get(key))} "
                    f"in the checkpoint, {short(expected)} in this run); refusing to resume "
                    "from it"
                )


def short(value) -> str:
    """A value for a message: hashes cut to 12 hex digits."""
    if isinstance(value, str) and len(value) == 64:
        return repr(value[:12] + "...")
    return repr(value)
