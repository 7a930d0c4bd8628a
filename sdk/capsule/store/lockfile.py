"""The store's LOCK file: an exclusive fcntl.flock held while a process has the store open.

flock locks belong to the open file description and vanish when the holder dies (even by
SIGKILL), so a crashed writer never leaves a stale lock behind.

A failed open of a new store removes what it created, LOCK included (lock_folder): acquire()
therefore checks, once it holds the flock, that its file is still the one at `path`, and retries
if the file was unlinked (or replaced) meanwhile, so two openers never lock two different files.

LOCK is opened with fsafe.open_regular: a LOCK that is a link (or a FIFO, ...) is refused with
UnsafeStore, never written through.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import fsafe
from .errors import StoreLocked

_SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")

# (st_dev, st_ino) of each LOCK this process holds -> the pid that took it (a forked child
# inherits the dict but is another process)
_held: dict[tuple[int, int], int] = {}


def acquire(path: Path) -> int:
    """Take the lock or raise StoreLocked; returns the fd to pass to release()."""
    for _ in range(100):
        fd, created = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(path, fd) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            st = os.fstat(fd)
            if not _is_current(path, st):
                os.close(fd)    # unlinked by a failed opener after we opened it: lock the new file
                continue
            # the pid is only a hint for the message in _locked; the flock is what excludes
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            if created:         # e.g. ENOSPC writing the pid: leave no LOCK behind (we hold it)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            os.close(fd)
            raise
        _held[(st.st_dev, st.st_ino)] = os.getpid()
        return fd
    raise StoreLocked(f"capsule store {path.parent}: its LOCK file keeps being replaced by another "
                      f"process; stop the processes opening this store folder and try again")


def _open(path: Path) -> tuple[int, bool]:
    """(fd, whether this call created the file). UnsafeStore if LOCK is a link or no regular file."""
    while True:
        try:
            return fsafe.open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            pass
        try:
            return fsafe.open_regular(path, os.O_RDWR), False
        except FileNotFoundError:   # unlinked in between: try to create it again
            continue


def _is_current(path: Path, st: os.stat_result) -> bool:
    try:
        now = os.lstat(path)   # a link put in its place is not our file
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _locked(path: Path, fd: int) -> StoreLocked:
    """The error for a LOCK held elsewhere (closes fd): this process or which other one."""
    try:
        st = os.fstat(fd)
        mine = _held.get((st.st_dev, st.st_ino)) == os.getpid()
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
    finally:
        os.close(fd)
    if mine:
        return StoreLocked(f"capsule store {path.parent} is already open in this process: close the "
                           f"other Session (or Store) first")
    return StoreLocked(f"capsule store {path.parent} is open for writing in another process (pid "
                       f"{holder} holds {path}); close that Session/process first, or use another "
                       f"store folder")


def release(fd: int, *, unlink: Path | None = None) -> None:
    """Drop the lock; unlink: the LOCK file's path, removed first (while still held)."""
    try:
        st = os.fstat(fd)
        if _held.get((st.st_dev, st.st_ino)) == os.getpid():
            del _held[(st.st_dev, st.st_ino)]
        if unlink is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unlink)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass
class FolderLock:
    """A store folder's held LOCK, and what to remove if the open fails (see lock_folder)."""
    path: Path
    fd: int
    made: list[Path]            # folders mkdir created, deepest first
    lock_created: bool
    owned: tuple[str, ...]      # the names (files, or folders with all they hold) the store makes
    before: set[str] | None     # those present before the open, when the store was new; None: not new

    def abandon(self) -> None:
        """Release after a failed open; for a new store, first remove the owned entries it added."""
        if self.before is None:
            release(self.fd)
            return
        added = _entries(self.path, self.owned) - self.before
        # an SQLite file that was there keeps its companions: after a checkpoint cut short (a full
        # disk) the main file is short and only its -wal holds the committed pages
        added -= {f"{n}{s}" for n in self.before for s in _SQLITE_COMPANIONS}
        for name in sorted(added, reverse=True):  # a/x before a
            target = self.path / name
            with contextlib.suppress(OSError):
                if target.is_dir() and not target.is_symlink():
                    target.rmdir()
                else:
                    target.unlink()
        release(self.fd, unlink=self.path / "LOCK" if self.lock_created else None)
        _remove_dirs(self.made)


def check_folder(path: Path, owned: tuple[str, ...]) -> None:
    """Refuse (UnsafeStore), before anything is created or locked, a folder whose LOCK or owned
    entries are links, or neither regular files nor real folders (FIFOs, sockets, devices). What is
    inside owned folders is checked where it is listed (segments.list_segment_files)."""
    if not os.path.isdir(path):
        return   # created by lock_folder
    for name in ("LOCK",) + owned:
        st = fsafe.lstat(path / name)
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise fsafe.refusal(path / name, st.st_mode)


def lock_folder(path: Path, *, is_new: Callable[[], bool], owned: tuple[str, ...]) -> FolderLock:
    """Create the folder if needed (0700) and take its LOCK. is_new is asked under the lock:
    when True, FolderLock.abandon removes the folders mkdir made, the LOCK if this call made it,
    and the `owned` entries the open added (nothing else: the folder may hold the user's files)."""
    made = []
    p = path
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_existed = os.path.lexists(path / "LOCK")
        fd = acquire(path / "LOCK")
    except BaseException:
        _remove_dirs(made)  # only those still empty
        raise
    try:
        before = _entries(path, owned) if is_new() else None
    except BaseException:
        release(fd)
        raise
    return FolderLock(path, fd, made, not lock_existed, owned, before)


def _entries(path: Path, owned: tuple[str, ...]) -> set[str]:
    """The owned names present in the folder and, as "sub/name", what the owned subfolders hold."""
    names = {n for n in owned if os.path.lexists(path / n)}
    for n in list(names):
        if (path / n).is_dir() and not (path / n).is_symlink():
            names |= {f"{n}/{m}" for m in os.listdir(path / n)}
    return names


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first; rmdir refuses a folder that holds anything
        try:
            d.rmdir()
        except OSError:
            return
