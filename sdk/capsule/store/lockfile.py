"""The store's LOCK file: an exclusive fcntl.flock held while a process has the store open.

flock locks belong to the open file description and vanish when the holder dies (even by
SIGKILL), so a crashed writer never leaves a stale lock behind.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import StoreLocked


def acquire(path: Path) -> int:
    """Take the lock or raise StoreLocked; returns the fd to pass to release()."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise StoreLocked(f"capsule store {path.parent} is open for writing in another process (pid "
                          f"{holder} holds {path}); close that Session/process first, or use another "
                          f"store folder") from None
    except BaseException:
        os.close(fd)
        raise
    # the pid is only a hint for the message above; the flock is what excludes
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
