"""A training run killed during a step, as a kill would leave it: the step started, its
checkpoint not written, the run directory closed."""

from __future__ import annotations

import pytest


class Killed(Exception):
    pass


def kill_during_step(trainer, step: int) -> None:
    """Train ``trainer`` until step ``step`` begins, then die there (``Killed``) and close."""
    run_step = trainer.run_step

    def dies(index):
        if index == step:
            raise Killed
        return run_step(index)

    trainer.run_step = dies
    with pytest.raises(Killed):
        trainer.train()
    trainer.close()
