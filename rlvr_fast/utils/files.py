"""Every file rlvr_fast writes goes through here: whole files replace the old one atomically,
JSONL lines are appended and synced, and a kill at any moment leaves the old file or the new one.

    with atomic_path(path) as temp:        # write temp however you like (save_file, savefig)
        save_file(tensors, str(temp))
    write_text_atomic(path, text)          # the same for text and JSON
    with replaced_directory(directory) as staging:   # a directory of files, swapped in whole
        write_model_files(model, staging)
    with files_into(directory) as staging:           # files added to a directory, each whole
        model.save_pretrained(staging)
    remove_stale_files(run_dir)            # on start: temp files of killed writers, a half swap

A writer's temp file sits beside its target (``.NAME.RANDOM.tmp``; safetensors' own temp file,
``.tmpRANDOM``, lands there too) so that ``os.replace`` stays on one filesystem; ``replaced_directory`` moves the old directory to ``.NAME.old`` for the
instant between its two renames. ``remove_stale_files`` knows both names: it deletes the temp
files and, when a kill fell between the renames, puts ``.NAME.old`` back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TEMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"


def temp_name_prefix(path: Path) -> str:
    return f".{path.name}."


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path beside ``path`` to write; once the block ends, the file is synced and renamed
    onto ``path``. If the block raises, the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(
        dir=path.parent, prefix=temp_name_prefix(path), suffix=TEMP_SUFFIX
    )
    os.close(handle)
    temp = Path(name)
    try:
        yield temp
        fsync_file(temp)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as temp:
        temp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line and sync it: a kill leaves at most a partial last line, which a resume
    drops (``rlvr_fast.run.directory.whole_lines``)."""
    with open(path, "a", encoding="utf-8") as file:
        file.write(line + "\n")
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def replaced_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """An empty staging directory beside ``directory``; once the block ends, its files are
    synced and it replaces ``directory`` whole (what was there is removed). If the block raises,
    the staging directory is removed and ``directory`` is untouched."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(
            dir=directory.parent, prefix=temp_name_prefix(directory), suffix=TEMP_SUFFIX
        )
    )
    try:
        yield staging
        for item in staging.iterdir():
            if item.is_file():
                fsync_file(item)
        fsync_directory(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = old_directory(directory)
    if old.exists():
        # A kill between the two renames below, earlier: staging holds newer files than it.
        shutil.rmtree(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(staging, directory)
    fsync_directory(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def files_into(directory: str | os.PathLike) -> Iterator[Path]:
    """An empty staging directory beside ``directory``; once the block ends, each file written
    there is synced and renamed into ``directory`` (made if missing), replacing a file of its
    name and keeping every other entry (a Hugging Face ``save_model`` into a directory that also
    holds checkpoints). Each file is whole; a kill between two renames leaves some files new and
    some old. If the block raises, ``directory`` is untouched."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(
            dir=directory.parent, prefix=temp_name_prefix(directory), suffix=TEMP_SUFFIX
        )
    )
    try:
        yield staging
        for item in staging.iterdir():
            if not item.is_file():
                raise IsADirectoryError(f"{item}: files_into moves files only")
            fsync_file(item)
        for item in sorted(staging.iterdir()):
            os.replace(item, directory / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    fsync_directory(directory)


def old_directory(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}{OLD_SUFFIX}")


def remove_stale_files(root: str | os.PathLike) -> list[Path]:
    """Clean up after writers killed under ``root`` (searched recursively): delete their temp
    files and staging directories; where a directory swap was cut between its renames, move
    ``.NAME.old`` back to ``NAME``, or delete it when ``NAME`` is in place. Returns what was
    removed or restored."""
    touched = []
    for directory, subdirectories, files in os.walk(root):
        directory = Path(directory)
        for name in files:
            if is_temp_name(name):
                (directory / name).unlink(missing_ok=True)
                touched.append(directory / name)
        for name in list(subdirectories):
            path = directory / name
            if is_temp_name(name):
                shutil.rmtree(path, ignore_errors=True)
                subdirectories.remove(name)
                touched.append(path)
            elif name.startswith(".") and name.endswith(OLD_SUFFIX):
                target = directory / name[1 : -len(OLD_SUFFIX)]
                if target.exists():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.replace(path, target)
                subdirectories.remove(name)
                touched.append(path)
    return touched


# safetensors' save_file writes through a temp file of its own beside the target (Rust's
# tempfile crate: ".tmp" and six letters or digits), which a kill leaves behind too.
RUST_TEMP_NAME = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def is_temp_name(name: str) -> bool:
    return (name.startswith(".") and name.endswith(TEMP_SUFFIX)) or RUST_TEMP_NAME.fullmatch(
        name
    ) is not None
