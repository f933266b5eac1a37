"""``output_dir/checkpoint-N`` as transformers writes it, and resuming from one.

A checkpoint holds the model as a Hugging Face directory (loadable by ``from_pretrained`` and
``rlvr_fast.load_policy``), the processing class, ``trainer_state.json`` (transformers'
``TrainerState``) and, unless ``save_only_model``, ``rlvr_fast/state.safetensors``: every
component the next step reads (weights, AdamW moments, the sampling generator, torch's RNG),
written by the run's ``rlvr_fast.run.checkpoint.Checkpointer``. Resuming loads that state and
replays what is a function of the step alone (the learning-rate schedule, the prompts' order),
so a resumed run continues bit for bit as the uninterrupted one. ``save_total_limit`` keeps the
newest checkpoints.

Each checkpoint lists the SHA-256 of every file it holds (``rlvr_fast/manifest.json``, written
last); a resume checks them before it reads anything, and refuses a checkpoint with a missing or
changed file naming it (the state file also carries its own digest and the run's identity,
``rlvr_fast.run.checkpoint``). A checkpoint written before manifests resumes with a warning.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

from rlvr_fast.utils.files import UnreadableFileError, read_json, replaced_directory

PREFIX = "checkpoint-"
# In a folder of its own: checkpoint loaders read every *.safetensors beside config.json.
STATE_FILE = "rlvr_fast/state.safetensors"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "rlvr_fast/manifest.json"
MAX_MANIFEST_BYTES = 16 << 20


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
        write_manifest(staging)
    return directory


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and not p.is_symlink() and str(p.relative_to(directory)) != MANIFEST
    )


def write_manifest(directory: Path) -> None:
    files = {name: file_sha256(directory / name) for name in checkpoint_files(directory)}
    (directory / MANIFEST).parent.mkdir(exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps({"sha256": files}, indent=1) + "\n")


def check_manifest(checkpoint: Path) -> None:
    """Refuse ``checkpoint`` unless every file its manifest lists is there, a regular file,
    with the recorded SHA-256 (files added since, a user's notes, are not the checkpoint's)."""
    path = checkpoint / MANIFEST
    if not path.exists():
        warnings.warn(
            f"{checkpoint} was written before checkpoints listed their files' digests; "
            "resuming without checking them",
            stacklevel=3,
        )
        return
    try:
        manifest = read_json(path, MAX_MANIFEST_BYTES, "checkpoint manifest")
    except UnreadableFileError as err:
        raise ValueError(str(err)) from None
    files = manifest.get("sha256") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{path}: not a checkpoint manifest")
    for name, expected in sorted(files.items()):
        file = checkpoint / name
        if not checkpoint.joinpath(name).resolve().is_relative_to(checkpoint.resolve()):
            raise ValueError(f"{path}: lists {name!r}, outside the checkpoint")
        if file.is_symlink() or not file.is_file():
            raise ValueError(f"{checkpoint}: {name} is missing; the checkpoint is incomplete")
        if file_sha256(file) != expected:
            raise ValueError(
                f"{checkpoint}: {name} differs from the file the checkpoint was written with "
                "(damaged or edited); resume from an intact checkpoint"
            )


def rotate(output_dir: Path, limit: int | None) -> None:
    """Delete the oldest checkpoints beyond ``limit`` (None: keep all)."""
    if limit is None:
        return
    found = checkpoint_dirs(output_dir)
    for stale in found[: max(0, len(found) - max(limit, 1))]:
        shutil.rmtree(stale)
