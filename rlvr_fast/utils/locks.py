"""One writer per directory (or per output file) for the holder's life, and a holder that
knows when its lock is gone.

    lock = lock_directory(run_dir)       # DIRECTORY/.rlvr_fast.lock, and the directory itself
    lock.check()                         # before each write: LockLostError once the file is gone
    lock = lock_output(path)             # an output file's lock, in the cache directory

A lock is an advisory ``flock`` on a lock file that holds the holder's pid; the kernel drops it
when the holder's last descriptor closes, so a killed holder's lock is taken over by the next
writer. Three things keep two writers apart even when someone deletes or replaces that file:

* the holder checks (``check``) before every write that the lock file on disk is still the one
  it holds (same device and inode) and stops with ``LockLostError`` when it is not;
* ``lock_directory`` also locks the directory itself, which no file operation inside it can
  swap: a newcomer that made a fresh lock file while the holder lives is still refused;
* a newcomer checks, once it holds the lock, that the file it locked is still the one at the
  path (a holder removes its file before letting go), and tries again when it is not.

That last rule makes removing a lock file race-free, so locks taken with ``remove=True`` (a run
directory's, an output file's) are removed when the process exits normally; output directories
whose lock file marks them as ours (eval, report, sweep) keep it. An output file's lock lives in
``$XDG_CACHE_HOME/rlvr_fast/locks/`` (``~/.cache`` by default), never beside the user's files.
Where a directory cannot be locked (flock on a directory descriptor is refused by some network
filesystems) the lock file alone keeps writers apart.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import time
from pathlib import Path

LOCK_NAME = ".rlvr_fast.lock"
# A holder writes its pid just after it takes the lock; a newcomer refused in that instant
# reads again for this long before it names the holder "unknown".
PID_WAIT_SECONDS = 1.0
# flock on a directory descriptor fails with these where the filesystem cannot lock one.
NO_DIRECTORY_LOCK = (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP)


class DirectoryLockedError(ValueError):
    """Another live process holds the directory's lock; the message names its pid."""


class LockLostError(RuntimeError):
    """The lock file this process holds was removed or replaced: another writer may be at work,
    so the holder writes nothing more (the command exits with status 3)."""


class DirectoryLock:
    """A held lock: its lock file (``path``, descriptor ``fd``), the directory descriptor it
    also locks (or None), and what it guards (what messages name)."""

    def __init__(
        self, path: Path, fd: int, guarded: Path, directory_fd: int | None, remove: bool
    ) -> None:
        self.path, self.guarded = path, guarded
        self.directory = path.parent
        self.fd: int | None = fd
        self.directory_fd = directory_fd
        self.remove = remove

    @property
    def held(self) -> bool:
        return self.fd is not None and same_file(self.path, self.fd)

    def check(self) -> None:
        """Raise ``LockLostError`` unless the lock file on disk is still the one held."""
        if not self.held:
            raise LockLostError(
                f"{self.guarded}: the lock file {self.path} was removed or replaced while this "
                f"process (pid {os.getpid()}) held it; stopped without writing more, as another "
                "process may be writing there now"
            )

    def release(self, *, remove: bool = False) -> None:
        """Let go; with ``remove``, delete the lock file first (while still holding it, so a
        newcomer that opened it finds it gone and makes a new one)."""
        if remove and self.held:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for fd in (self.fd, self.directory_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.directory_fd = None
        if _HELD.get(self.path) is self:
            del _HELD[self.path]

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release(remove=self.remove)


_HELD: dict[Path, DirectoryLock] = {}


def lock_directory(directory: str | os.PathLike, *, remove: bool = False) -> DirectoryLock:
    """Take ``directory``'s lock before writing anything into it; held until ``release`` or
    the process ends (``remove``: the lock file is deleted then). Raises
    ``DirectoryLockedError`` naming the pid of a live holder."""
    directory = Path(directory).resolve()
    return take_lock_file(directory / LOCK_NAME, directory, lock_directory_too=True, remove=remove)


def lock_output(path: str | os.PathLike) -> DirectoryLock:
    """The lock of one output file, as ``lock_directory``; its lock file is in the cache
    directory (``locks_directory``), named by a hash of the output's absolute path, and is
    removed when the process exits."""
    path = Path(path).resolve()
    name = hashlib.sha256(os.fsencode(path)).hexdigest()[:32]
    folder = locks_directory()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DirectoryLockedError(
            f"{folder}: cannot make the lock directory ({reason(err)})"
        ) from None
    return take_lock_file(folder / f"{name}.lock", path, lock_directory_too=False, remove=True)


def locks_directory() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "rlvr_fast" / "locks"


def take_lock_file(
    path: Path, guarded: Path, *, lock_directory_too: bool, remove: bool
) -> DirectoryLock:
    """Lock ``path``, the lock file of ``guarded``, and (``lock_directory_too``) its directory."""
    held = _HELD.get(path)
    if held is not None and held.held:
        held.remove = held.remove or remove
        return held
    if held is not None:
        held.release()  # the lock file was removed or replaced since: take it anew
    while True:
        fd = open_lock_file(path)
        try:
            take_lock(fd, path, guarded)
        except BaseException:
            os.close(fd)
            raise
        if same_file(path, fd):
            break
        os.close(fd)  # its holder removed it as it let go: lock the one at the path now
    try:
        directory_fd = lock_the_directory(path.parent, guarded) if lock_directory_too else None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)  # ours, made while another process holds the directory
        os.close(fd)
        raise
    write_pid(fd)
    lock = DirectoryLock(path, fd, guarded, directory_fd, remove)
    _HELD[path] = lock
    return lock


def open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        raise DirectoryLockedError(f"{path}: cannot open the lock file ({reason(err)})") from None


def take_lock(fd: int, path: Path, guarded: Path) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise DirectoryLockedError(f"{path}: the lock file is not a regular file")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DirectoryLockedError(
            f"{guarded}: in use by process {holder_pid(fd)} (it holds {path.name}); wait for it "
            "to finish or stop it"
        ) from None
    except OSError as err:
        raise DirectoryLockedError(f"{path}: cannot lock ({reason(err)})") from None


def holder_pid(fd: int) -> str:
    """The pid in a lock file another process holds; it writes it just after locking, so an
    empty file is read again for a moment."""
    deadline = time.monotonic() + PID_WAIT_SECONDS
    while True:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if pid or time.monotonic() > deadline:
            return pid or "unknown"
        time.sleep(0.01)


def write_pid(fd: int) -> None:
    # Written before the truncation, so the file is never empty when it held a pid before.
    text = f"{os.getpid()}\n".encode()
    os.pwrite(fd, text, 0)
    os.ftruncate(fd, len(text))


def lock_the_directory(directory: Path, guarded: Path) -> int | None:
    """The directory's own flock; None where the filesystem cannot lock a directory."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryLockedError(
            f"{guarded}: in use by another process, whose lock file {LOCK_NAME} was removed or "
            "replaced (it stops at its next write); wait for it to finish or stop it"
        ) from None
    except OSError as err:
        os.close(fd)
        if err.errno in NO_DIRECTORY_LOCK:
            return None
        raise DirectoryLockedError(f"{directory}: cannot lock ({reason(err)})") from None
    return fd


def same_file(path: Path, fd: int) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def forget_locks_after_fork() -> None:
    """A forked child closes its copies of the lock descriptors: the parent keeps its locks,
    and a child that outlives it does not keep the directory locked."""
    for lock in list(_HELD.values()):
        lock.release()


def release_at_exit() -> None:
    """At a normal exit, remove the lock files taken with ``remove`` and let every lock go."""
    for lock in list(_HELD.values()):
        lock.release(remove=lock.remove)


os.register_at_fork(after_in_child=forget_locks_after_fork)
atexit.register(release_at_exit)
