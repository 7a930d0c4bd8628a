"""Safe file primitives: every path the store opens goes through these.

The store owns a folder and trusts nothing in it (see docs/FORMAT.md, "Files the store opens"):
- it never follows a symbolic link inside the folder: a link could make it read, write, truncate
  or delete a file anywhere the process can reach;
- it opens only regular files, and never blocks on a FIFO (a FIFO opened for reading waits for
  a writer forever) nor opens a device node;
- refusals are `UnsafeStore` errors (a StoreError) that name the entry and say what to do; real
  I/O errors stay OSError.

The store folder itself may be a link (a user's /data/robot -> /mnt/sd/robot): the caller resolves
it once (os.path.realpath) and then checks every entry inside with these functions.
"""
from __future__ import annotations

import errno
import os
import stat
import urllib.parse
from pathlib import Path
from typing import Callable

from .errors import UnsafeStore

_SAFE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO cannot block the open


def kind(mode: int) -> str:
    """What a file of this st_mode is, in words."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return words
    return "not a regular file"


def refusal(path: str | os.PathLike[str], mode: int, wanted: str = "regular file") -> UnsafeStore:
    """The error for an entry of the wrong kind (mode: its lstat st_mode)."""
    if stat.S_ISLNK(mode):
        return UnsafeStore(f"{os.fspath(path)} is a symbolic link; the store never follows links out of its "
                           f"folder: replace it with the real file or move the folder away")
    return UnsafeStore(f"{os.fspath(path)} is {kind(mode)}, not a {wanted}; the store uses only regular files "
                       f"and folders of its own there: move it away (or put the store's real {wanted} back)")


def lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    """os.lstat, or None when the path is missing."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_entry(path: str | os.PathLike[str]) -> None:
    """Refuse (UnsafeStore) a path that exists and is not a regular file: a link, a folder, a FIFO,
    a socket or a device. A missing path is fine. For files opened by others (SQLite) that cannot
    take O_NOFOLLOW; it only looks (lstat), it never opens."""
    st = lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise refusal(path, st.st_mode)


def check_dir(path: str | os.PathLike[str]) -> None:
    """Refuse (UnsafeStore) a path that is not a real directory (a link to one is refused: the
    store would write into the folder it points at). FileNotFoundError if it is missing."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise refusal(path, st.st_mode, "folder")


def ensure_dir(path: str | os.PathLike[str], mode: int = 0o700) -> None:
    """mkdir (mode 0700 by default) if missing, then check_dir: an existing link is never followed."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    check_dir(path)


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """os.open that never follows a link, never blocks and yields only a regular file.

    O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK are added to flags (O_NONBLOCK has no effect on a regular
    file). The entry is looked at (lstat) before the open, so a device node is refused without being
    opened, and the open file is checked (fstat) after it, so a swap in between is caught too.
    O_CREAT | O_EXCL works as usual (FileExistsError when a regular file is there). Raises
    UnsafeStore for a link or a non-regular file, OSError for real I/O errors.
    """
    st = lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise refusal(path, st.st_mode)
    try:
        fd = os.open(path, flags | _SAFE_FLAGS, mode)
    except OSError as exc:
        # ELOOP: a link (O_NOFOLLOW); ENXIO: a FIFO without reader or a socket; EISDIR: a folder;
        # EEXIST with O_EXCL: maybe a link. All of these may be a swap since the lstat above.
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EEXIST):
            now = lstat(path)
            if now is not None and not stat.S_ISREG(now.st_mode):
                raise refusal(path, now.st_mode) from None
        raise
    try:
        now = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(now.st_mode):
        os.close(fd)
        raise refusal(path, now.st_mode)
    return fd


def sqlite_uri(path: str | os.PathLike[str]) -> str:
    """A file: URI for sqlite3.connect(..., uri=True) that makes SQLite refuse a link (nofollow=1,
    SQLite >= 3.31: SQLITE_CANTOPEN_SYMLINK; it refuses a link anywhere in the path, so the folder
    is resolved here first: only the file name itself must not be a link)."""
    p = Path(path)
    full = os.path.join(os.path.realpath(p.parent), p.name)
    return f"file:{urllib.parse.quote(full, safe='/')}?nofollow=1"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder (makes a create, rename or unlink in it durable); a link is refused (ELOOP)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: str | os.PathLike[str]) -> Path:
    """Where create_by_rename builds `path`: `path`.new, in the same folder."""
    p = Path(path)
    return p.with_name(p.name + ".new")


def discard_temp(path: str | os.PathLike[str]) -> None:
    """Remove create_by_rename's temporary file for `path`, left by a build a crash cut short: it
    never was `path`. A link there is removed itself (never its target); a folder, FIFO, ... is
    refused (UnsafeStore) rather than removed."""
    tmp = temp_name(path)
    st = lstat(tmp)
    if st is None:
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise refusal(tmp, st.st_mode)
    os.unlink(tmp)


def create_by_rename(path: str | os.PathLike[str], build: Callable[[Path], None], mode: int = 0o600) -> None:
    """Make `path` whole or not at all: build(tmp) fills an empty temporary file (temp_name, mode
    0600, created O_EXCL after discard_temp), which is then fsynced, renamed over `path` and the
    folder fsynced. A crash at any point leaves `path` as it was (plus the temporary file, which
    discard_temp removes); a failure removes the temporary file and re-raises."""
    tmp = temp_name(path)
    discard_temp(path)
    os.close(open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
    try:
        build(tmp)
        fd = open_regular(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # removed at the next open (discard_temp)
        raise
    fsync_dir(Path(path).parent)
