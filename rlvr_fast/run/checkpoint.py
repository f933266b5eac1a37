"""Checkpoints of a run: the state of every checkpointed component in one safetensors state file
(``rlvr_fast.run.state_file``: no pickle), written atomically.

The trainer hands the ``Checkpointer`` its components by name (torchtitan's pattern): each has
``state_dict()`` / ``load_state_dict()``, and may have ``check_state(state)``, which runs for
every component before any is restored, so that a damaged or foreign file fails whole, not
steps later. A component given as None saves None and restores nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from rlvr_fast.run.state_file import StateFileError, load_state, save_state


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


class Checkpointer:
    """Saves and restores ``components`` (name -> Stateful or None) with the step to continue
    from, at most ``steps``, and the world size that wrote the file."""

    def __init__(self, components: dict[str, Stateful | None], *, steps: int) -> None:
        self.components, self.steps = components, steps

    def save(self, path: Path, next_step: int, world_size: int) -> None:
        state = {"next_step": next_step, "world_size": world_size}
        for name, component in self.components.items():
            state[name] = component.state_dict() if component is not None else None
        save_state(path, state)

    def load(self, path: Path, check_world_size: Callable[[int, Path], None]) -> int:
        """Restore the checkpoint at ``path``; returns the step to continue from. State files
        load onto the CPU: Generator.set_state and torch.set_rng_state take CPU byte tensors (a
        CUDA generator's state too); load_state_dict copies weights and moments onto the
        parameters' device."""
        state = load_state(path)
        check_world_size(state.get("world_size", 1), path)
        try:
            next_step = state["next_step"]
            if (
                isinstance(next_step, bool)
                or not isinstance(next_step, int)
                or not 0 <= next_step <= self.steps
            ):
                raise ValueError(f"next_step {next_step!r} is outside [0, {self.steps}]")
            live = {name: c for name, c in self.components.items() if c is not None}
            for name, component in live.items():
                check = getattr(component, "check_state", None)
                if check is not None:
                    check(state[name])
            for name, component in live.items():
                component.load_state_dict(state[name])
        except RESTORE_ERRORS as err:
            message = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise StateFileError(f"{path}: not a checkpoint of this run ({message})") from None
        return next_step
