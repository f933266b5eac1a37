"""``output_dir/checkpoint-N`` as transformers writes it, and resuming from one.

A checkpoint holds the model as a Hugging Face directory (loadable by ``from_pretrained`` and
``rlvr_fast.load_policy``), the processing class, ``trainer_state.json`` (transformers'
``TrainerState``) and, unless ``save_only_model``, ``rlvr_fast/state.safetensors``: every
component the next step reads (weights, AdamW moments, the sampling generator, torch's RNG),
written by the run's ``rlvr_fast.run.checkpoint.Checkpointer``. Resuming loads that state and
replays what is a function of the step alone (the learning-rate schedule, the prompts' order),
so a resumed run continues bit for bit as the uninterrupted one. ``save_total_limit`` keeps the
newest checkpoints.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from rlvr_fast.utils.files import replaced_directory

PREFIX = "checkpoint-"
# In a folder of its own: checkpoint loaders read every *.safetensors beside config.json.
STATE_FILE = "rlvr_fast/state.safetensors"
TRAINER_STATE = "trainer_state.json"


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """``checkpoint-N`` directories under ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [
        p for p in output_dir.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def resolve_checkpoint(resume_from_checkpoint, output_dir: Path) -> Path | None:
    """``train(resume_from_checkpoint=...)``: True takes the newest checkpoint of output_dir, a
    path that checkpoint, None or False none."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = checkpoint_dirs(output_dir)
        if not found:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        return found[-1]
    path = Path(resume_from_checkpoint)
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(f"Can't find a valid checkpoint at {path}")
    if not (path / STATE_FILE).is_file():
        raise ValueError(
            f"{path} was saved with save_only_model=True: it has the model but not the optimizer "
            "and RNG state a resumed run continues from"
        )
    return path


def write_checkpoint(output_dir: Path, step: int, write_model, write_state, state) -> Path:
    """checkpoint-``step`` swapped in whole: ``write_model(dir)``, ``write_state(file)`` (None
    under save_only_model) and the trainer state."""
    directory = output_dir / f"{PREFIX}{step}"
    with replaced_directory(directory) as staging:
        write_model(staging)
        if write_state is not None:
            (staging / STATE_FILE).parent.mkdir()
            write_state(staging / STATE_FILE)
        state.save_to_json(str(staging / TRAINER_STATE))
    return directory


def rotate(output_dir: Path, limit: int | None) -> None:
    """Delete the oldest checkpoints beyond ``limit`` (None: keep all)."""
    if limit is None:
        return
    found = checkpoint_dirs(output_dir)
    for stale in found[: max(0, len(found) - max(limit, 1))]:
        shutil.rmtree(stale)
