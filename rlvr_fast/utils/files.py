"""Every file rlvr_fast writes goes through here: whole files replace the old one atomically,
JSONL lines are appended and synced, and a kill at any moment leaves the old file or the new one.
Every file it reads from a user goes through here too: bounded, regular files only.

    with atomic_path(path) as temp:        # write temp however you like (save_file, savefig)
        save_file(tensors, str(temp))
    write_text_atomic(path, text)          # the same for text and JSON
    with replaced_directory(directory) as staging:   # a directory of files, swapped in whole
        write_model_files(model, staging)
    with files_into(directory) as staging:           # files added to a directory, each whole
        model.save_pretrained(staging)
    remove_stale_files(lock, swapped)      # on start: temp files of killed writers, a half swap
    text = read_text(path, limit, "problem file")    # a size cap before reading; no FIFOs

A writer's temp file sits beside its target (``.NAME.RANDOM.tmp``, RANDOM eight letters or
digits; safetensors' own temp file, ``.tmpRANDOM``, lands there too) so that ``os.replace`` stays
on one filesystem; ``replaced_directory`` moves the old directory to ``.NAME.old`` for the
instant between its two renames. ``remove_stale_files`` knows these names and nothing else: it
runs only in a directory this process holds the lock of, deletes the temp files it recognises
as ours, and, when a kill fell between the renames, puts ``.NAME.old`` back.

File modes: everything written here gets the mode ``open()`` and ``mkdir`` give a new entry,
0o666 / 0o777 less the umask (0644 / 0755 under the usual 022), whether it was written
atomically, appended, or staged in a directory; a temp file's private mode never reaches a
target.

Errors name the target, never a temp file: an ``OSError`` (or safetensors' error carrying one)
raised while writing comes out as ``OSError(errno, reason, target)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from rlvr_fast.utils.locks import LOCK_NAME, DirectoryLock, DirectoryLockedError

TEMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
# The random part of our temp names: eight letters, digits or '_' (secrets.token_hex now,
# tempfile's alphabet before; both are recognised so a kill of either is cleaned up).
OUR_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX))
# safetensors' save_file writes through a temp file of its own beside the target (Rust's
# tempfile crate: ".tmp" and six letters or digits), which a kill leaves behind too.
RUST_TEMP_NAME = re.compile(r"\.tmp[A-Za-z0-9]{6}")
# The first bytes of a safetensors file: a little-endian u64 header length, then '{'.
SAFETENSORS_HEADER_LENGTH = 8


class UnreadableFileError(ValueError):
    """A file rlvr_fast reads is missing, not a regular file, too large, or not what its name
    says (invalid UTF-8 or JSON); the one-line message names the path."""


# ------------------------------------------------------------------ bounded reads
def read_bytes(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of ``path`` (a ``what``: "model config", "problem file"), refused with one
    line before reading when it is not a regular file (a FIFO would block forever, a device
    never ends) or holds more than ``limit`` bytes."""
    with open_regular(path, limit, what) as file:
        # Sized by the file, not the cap (read(n) allocates n bytes); a file that grew since
        # its fstat is read on, to one byte past the cap.
        expected = os.fstat(file.fileno()).st_size
        data = file.read(expected + 1)
        if len(data) > expected:
            data += file.read(limit + 1 - len(data))
    if len(data) > limit:
        raise UnreadableFileError(too_large(Path(path), len(data), limit, what))
    return data


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, limit: int, what: str) -> Iterator:
    """``path`` opened for binary reading once it is known to be a regular file of at most
    ``limit`` bytes (symlinks are followed: the target is what is checked)."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UnreadableFileError(f"{path}: no such file") from None
    except OSError as err:
        raise UnreadableFileError(f"{path}: cannot open ({reason(err)})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnreadableFileError(
            f"{path}: not a regular file ({file_kind(info.st_mode)}); a {what} must be one"
        )
    if info.st_size > limit:
        os.close(fd)
        raise UnreadableFileError(too_large(path, info.st_size, limit, what))
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as file:
        try:
            yield file
        except OSError as err:
            raise UnreadableFileError(f"{path}: cannot read ({reason(err)})") from None


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_text(path: str | os.PathLike, limit: int, what: str) -> str:
    """``read_bytes`` decoded as UTF-8 (a byte-order mark is dropped)."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UnreadableFileError(
            f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})"
        ) from None


def read_json(path: str | os.PathLike, limit: int, what: str):
    """The JSON document in ``path`` (``read_text``, then ``parse_json``)."""
    return parse_json(read_text(path, limit, what), str(path))


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's ``object_pairs_hook`` that refuses a key given twice (``json`` would keep
    the last value silently: ``{"answer": "2", "answer": "3"}`` would train on 3)."""
    found: dict = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"duplicate key {key!r} in one object")
        found[key] = value
    return found


def parse_json(text: str, where: str):
    """``json.loads`` whose every failure is one line naming ``where``: a syntax error (with
    its line and column), nesting past the recursion limit, an integer past Python's 4,300
    digits, a key given twice in one object."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as err:
        raise UnreadableFileError(
            f"{where}: invalid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None
    except RecursionError:
        raise UnreadableFileError(f"{where}: JSON nested too deeply") from None
    except ValueError as err:  # int() past sys.get_int_max_str_digits()
        raise UnreadableFileError(f"{where}: unreadable JSON ({one_line(err)})") from None


def too_large(path: Path, size: int, limit: int, what: str) -> str:
    return f"{path}: {size:,} bytes or more, over the {limit:,}-byte limit of a {what}"


def file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def regular_file_inside(directory: Path, name: str, *, roots: Iterable[Path] = ()) -> Path | None:
    """``directory / name`` when it is a regular file, None when it does not exist. A symlink
    is resolved and accepted only when its target lies inside ``directory`` or one of
    ``roots``; anything else (a link out, a FIFO, a device, a directory) is refused: a model
    directory is copied into a run, so a link out of it would copy a stranger's file. The path
    returned is the one asked for (errors then name it), not the link's target."""
    path = directory / name
    if not os.path.lexists(path):
        return None
    target = path.resolve()
    inside = [directory.resolve(), *(root.resolve() for root in roots)]
    if path.is_symlink() and not any(target.is_relative_to(root) for root in inside):
        raise UnreadableFileError(f"{path}: a symlink to {target}, outside the directory")
    info = os.stat(target) if target.exists() else None
    if info is None or not stat.S_ISREG(info.st_mode):
        kind = "a dangling symlink" if info is None else file_kind(info.st_mode)
        raise UnreadableFileError(f"{path}: not a regular file ({kind})")
    return path


def model_file(directory: Path, name: str) -> Path | None:
    """``regular_file_inside`` for a model directory: inside a Hugging Face cache snapshot
    (``models--ORG--NAME/snapshots/REVISION/``, whose files link to ``../../blobs/``) the
    repository's blobs/ count as inside."""
    resolved = directory.resolve()
    roots = [resolved.parent.parent / "blobs"] if resolved.parent.name == "snapshots" else []
    return regular_file_inside(directory, name, roots=roots)


# ------------------------------------------------------------------ atomic writes
def temp_name_prefix(path: Path) -> str:
    return f".{path.name}."


def new_temp_file(path: Path) -> tuple[Path, int]:
    """A new empty temp file beside ``path`` and its mode (what ``open`` gives a new file)."""
    while True:
        temp = path.with_name(f"{temp_name_prefix(path)}{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        os.close(fd)
        return temp, mode


def new_temp_directory(directory: Path) -> Path:
    while True:
        name = f"{temp_name_prefix(directory)}{secrets.token_hex(4)}{TEMP_SUFFIX}"
        staging = directory.with_name(name)
        try:
            staging.mkdir(0o777)
        except FileExistsError:
            continue
        return staging


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


def os_error_naming(err: BaseException, target: Path) -> OSError | None:
    """``err`` as an ``OSError`` about ``target`` when it carries an OS error about one of our
    temp files (a plain one, or safetensors' "... (os error 28) at path .tmpXXXXXX"); None
    otherwise (an error about another file keeps its own name)."""
    if isinstance(err, OSError) and err.errno is not None:
        where = untemp(err.filename, target)
        return None if where is None else OSError(err.errno, err.strerror, str(where))
    found = re.search(r"\(os error (\d+)\)", str(err))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(target))


def untemp(filename, target: Path) -> Path | None:
    """What ``filename`` (from an error) stands for: ``target`` for a temp file of ours, the
    same file inside ``target`` for one in a staging directory; None for another file."""
    if filename is None:
        return target
    parts = Path(os.fsdecode(filename)).parts
    temps = [i for i, part in enumerate(parts) if is_temp_name(part)]
    if not temps:
        return None
    return target.joinpath(*parts[temps[-1] + 1 :])


@contextlib.contextmanager
def errors_naming(target: Path) -> Iterator[None]:
    """OS errors about our temp files raised inside the block come out naming ``target``."""
    try:
        yield
    except Exception as err:
        renamed = os_error_naming(err, target)
        if renamed is None:
            raise
        raise renamed from None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path beside ``path`` to write; once the block ends, the file is synced and renamed
    onto ``path``. If the block raises, the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    with errors_naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        temp, mode = new_temp_file(path)
        try:
            yield temp
            # A writer may have replaced temp with a file of its own (safetensors: 0600).
            os.chmod(temp, mode)
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
    with errors_naming(Path(path)), open(path, "a", encoding="utf-8") as file:
        file.write(line + "\n")
        file.flush()
        os.fsync(file.fileno())


def settle_staged_files(staging: Path) -> None:
    """Give each file a writer left in ``staging`` the mode of a new file and sync it."""
    mode = stat.S_IMODE(os.stat(staging).st_mode) & 0o666
    for item in staging.iterdir():
        if item.is_file() and not item.is_symlink():
            os.chmod(item, mode)
            fsync_file(item)


def publish_staged_directory(staging: Path, final: Path) -> None:
    """Rename a fully written ``staging`` directory (one ``final`` does not name yet) into place,
    its files and the rename durable: a kill before the rename leaves only the staging folder."""
    settle_staged_files(staging)
    fsync_directory(staging)
    os.replace(staging, final)
    fsync_directory(final.parent)


@contextlib.contextmanager
def replaced_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """An empty staging directory beside ``directory``; once the block ends, its files are
    synced and it replaces ``directory`` whole (what was there is removed). If the block raises,
    the staging directory is removed and ``directory`` is untouched."""
    directory = Path(directory)
    with errors_naming(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = new_temp_directory(directory)
        try:
            yield staging
            settle_staged_files(staging)
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
    with errors_naming(directory):
        directory.mkdir(parents=True, exist_ok=True)
        staging = new_temp_directory(directory)
        try:
            yield staging
            for item in staging.iterdir():
                if not item.is_file():
                    raise IsADirectoryError(f"{item}: files_into moves files only")
            settle_staged_files(staging)
            for item in sorted(staging.iterdir()):
                os.replace(item, directory / item.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        fsync_directory(directory)


# ------------------------------------------------------------------ cleaning up after a kill
def old_directory(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}{OLD_SUFFIX}")


def remove_stale_files(lock: DirectoryLock, swapped: Iterable[str]) -> list[Path]:
    """Clean up after writers killed under the locked directory (searched recursively): delete
    the temp files and staging directories our writers name (``is_temp_name``; safetensors'
    only when they hold nothing or a safetensors header); where the swap of one of the
    ``swapped`` directories (names relative to the locked directory) was cut between its
    renames, move ``.NAME.old`` back to ``NAME``, or delete it when ``NAME`` is in place.
    Nothing else is touched. Returns what was removed or restored."""
    if not lock.held or lock.path.name != LOCK_NAME:
        raise DirectoryLockedError(f"{lock.directory}: cleaning needs the directory's lock")
    root = lock.directory
    olds = {old_directory(root / name) for name in swapped}
    touched = []
    for directory, subdirectories, files in os.walk(root):
        directory = Path(directory)
        for name in files:
            path = directory / name
            if is_temp_name(name) and is_our_temp_file(path):
                path.unlink(missing_ok=True)
                touched.append(path)
        for name in list(subdirectories):
            path = directory / name
            if is_temp_name(name) and OUR_TEMP_NAME.fullmatch(name) and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif path in olds and not path.is_symlink():
                restore_old_directory(path)
            else:
                continue
            subdirectories.remove(name)
            touched.append(path)
    return touched


def restore_old_directory(old: Path) -> None:
    target = old.with_name(old.name[1 : -len(OLD_SUFFIX)])
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, target)


def is_temp_name(name: str) -> bool:
    """A name one of our writers gives its temp file or staging directory."""
    return OUR_TEMP_NAME.fullmatch(name) is not None or RUST_TEMP_NAME.fullmatch(name) is not None


def is_our_temp_file(path: Path) -> bool:
    """A regular file under one of our temp names; safetensors' ``.tmpXXXXXX`` only when it
    is empty or starts as a safetensors file does (another program's may share the name)."""
    if path.is_symlink() or not path.is_file():
        return False
    if OUR_TEMP_NAME.fullmatch(path.name):
        return True
    with open(path, "rb") as file:
        head = file.read(SAFETENSORS_HEADER_LENGTH + 1)
    return len(head) == 0 or (len(head) > SAFETENSORS_HEADER_LENGTH and head[-1:] == b"{")
