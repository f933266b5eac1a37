"""``output_dir/checkpoint-N`` as transformers writes it, and resuming from one.

A checkpoint holds the model as a Hugging Face directory (loadable by ``from_pretrained`` and
``rlvr_fast.load_policy``), the processing class, ``trainer_state.json`` (transformers'
``TrainerState``) and, unless ``save_only_model``, ``rlvr_fast/state.safetensors``: every
component the next step reads (weights, AdamW moments, the sampling generator, torch's RNG),
written by the run's ``rlvr_fast.run.checkpoint.Checkpointer``. Resuming loads that state and
replays what is a function of the step alone (the learning-rate schedule, the prompts' order),
so a resumed run continues bit for bit as the uninterrupted one.

A checkpoint TRL wrote (``optimizer.pt`` in place of rlvr_fast's state) resumes through
``rlvr_fast.trl_compat.trl_checkpoint``.

``save_total_limit`` rotates as transformers does (None, 0 or less: keep every checkpoint; N:
the newest N), but only over the checkpoints this run wrote, which each checkpoint's manifest
records (so a resumed run knows its earlier ones): a user's ``checkpoint-99`` is never counted or
deleted, a symlink is never followed, and deleting a checkpoint removes the files its manifest
lists, keeping the directory when someone else's files are in it.

Each checkpoint lists the SHA-256 of every file it holds (``rlvr_fast/manifest.json``, written
last); a resume checks them before it reads anything, and refuses a checkpoint with a missing or
changed file naming it (the state file also carries its own digest and the run's identity,
``rlvr_fast.run.checkpoint``). A checkpoint written before manifests resumes with a warning.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from rlvr_fast.trl_compat.trl_checkpoint import is_trl_checkpoint
from rlvr_fast.utils.files import UnreadableFileError, file_sha256, read_json, replaced_directory

PREFIX = "checkpoint-"
# In a folder of its own: checkpoint loaders read every *.safetensors beside config.json.
STATE_FILE = "rlvr_fast/state.safetensors"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "rlvr_fast/manifest.json"
MAX_MANIFEST_BYTES = 16 << 20


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """``checkpoint-N`` directories under ``output_dir``, oldest first."""
    try:
        entries = list(output_dir.iterdir())
    except OSError:  # missing, or not a directory
        return []
    found = [p for p in entries if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()]
    return sorted(found, key=step_of)


def step_of(path: Path | str) -> int:
    return int(Path(path).name[len(PREFIX) :])


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
    if not (path / STATE_FILE).is_file() and not is_trl_checkpoint(path):
        raise ValueError(
            f"{path} was saved with save_only_model=True: it has the model but not the optimizer "
            "and RNG state a resumed run continues from"
        )
    return path


def write_checkpoint(
    output_dir: Path, step: int, write_model, write_state, state, written: list[str]
) -> Path:
    """checkpoint-``step`` swapped in whole: ``write_model(dir)``, ``write_state(file)`` (None
    under save_only_model), the trainer state, and the manifest, which records ``written`` (the
    checkpoints the run wrote before) with this one."""
    directory = output_dir / f"{PREFIX}{step}"
    with replaced_directory(directory) as staging:
        write_model(staging)
        if write_state is not None:
            (staging / STATE_FILE).parent.mkdir()
            write_state(staging / STATE_FILE)
        state.save_to_json(str(staging / TRAINER_STATE))
        write_manifest(staging, sorted({*written, directory.name}, key=step_of))
    return directory


def checkpoint_files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and not p.is_symlink() and str(p.relative_to(directory)) != MANIFEST
    )


def write_manifest(directory: Path, written: list[str]) -> None:
    files = {name: file_sha256(directory / name) for name in checkpoint_files(directory)}
    (directory / MANIFEST).parent.mkdir(exist_ok=True)
    document = {"sha256": files, "checkpoints_written": written}
    (directory / MANIFEST).write_text(json.dumps(document, indent=1) + "\n")


def read_manifest(checkpoint: Path) -> dict | None:
    """A checkpoint's manifest; None when it has none (written before manifests)."""
    path = checkpoint / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = read_json(path, MAX_MANIFEST_BYTES, "checkpoint manifest")
    except UnreadableFileError as err:
        raise ValueError(str(err)) from None
    files = manifest.get("sha256") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{path}: not a checkpoint manifest")
    return manifest


def checkpoints_written(checkpoint: Path) -> list[str]:
    """The checkpoints the run that wrote ``checkpoint`` had written by then (its manifest)."""
    manifest = read_manifest(checkpoint)
    names = (manifest or {}).get("checkpoints_written", [])
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and re.fullmatch(r"checkpoint-\d+", n)]


def check_manifest(checkpoint: Path) -> None:
    """Refuse ``checkpoint`` unless every file its manifest lists is there, a regular file,
    with the recorded SHA-256 (files added since, a user's notes, are not the checkpoint's)."""
    path = checkpoint / MANIFEST
    manifest = read_manifest(checkpoint)
    if manifest is None:
        warnings.warn(
            f"{checkpoint} was written before checkpoints listed their files' digests; "
            "resuming without checking them",
            stacklevel=3,
        )
        return
    for name, expected in sorted(manifest["sha256"].items()):
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


def rotate(output_dir: Path, limit: int | None, written: list[str]) -> list[str]:
    """transformers' ``_rotate_checkpoints`` over ``written``, the checkpoints this run wrote:
    None or a limit <= 0 keeps all; otherwise the oldest beyond ``limit`` are deleted. Returns
    the checkpoints of the run still there."""
    ours = sorted(
        (name for name in set(written) if is_checkpoint_directory(output_dir / name)), key=step_of
    )
    if limit is None or limit <= 0:
        return ours
    for name in ours[: max(0, len(ours) - limit)]:
        remove_checkpoint(output_dir / name)
    return ours[max(0, len(ours) - limit) :]


def is_checkpoint_directory(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir()


def remove_checkpoint(directory: Path) -> None:
    """Delete the files ``directory``'s manifest lists, and the directory once that empties it;
    a checkpoint holding files the run did not write (a user's notes) keeps them, with a
    warning. Files another process removed first are not an error."""
    try:
        manifest = read_manifest(directory)
    except ValueError:
        manifest = None
    if manifest is None:
        warnings.warn(f"{directory}: kept, its manifest is missing or unreadable", stacklevel=3)
        return
    for name in [*manifest["sha256"], MANIFEST]:
        path = directory / name
        if path.resolve().is_relative_to(directory.resolve()) and not path.is_symlink():
            path.unlink(missing_ok=True)
    for folder in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        remove_if_empty(folder)
    if not remove_if_empty(directory) and directory.exists():
        warnings.warn(
            f"{directory}: kept the files the run did not write in it "
            f"({', '.join(sorted(p.name for p in directory.iterdir())[:3])})",
            stacklevel=3,
        )


def remove_if_empty(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:
        return False
    return True
