"""The store's folder: the entries it owns, whether a folder holds a store, and the path checks
made before its LOCK is taken (see Store.open)."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import StoreError
from . import lockfile
from .segments import list_segment_files

# what a store puts in its folder besides LOCK (a failed open of a new store removes them again)
OWNED = ("segments", "index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "index.sqlite-journal",
         "index.sqlite.new", "index.sqlite.rebuild", "quarantine")


def folder_path(path: str | os.PathLike, create: bool) -> Path:
    """The store folder, resolved once (the folder itself may be a link, /data/robot ->
    /mnt/sd/robot; no entry inside may be one: UnsafeStore from lockfile.check_folder, fsafe,
    list_segment_files). StoreError for a dangling link, a regular file, or a missing store
    when create is False."""
    if os.path.islink(path) and not os.path.exists(path):
        raise StoreError(f"store path {os.fspath(path)!r} is a link to {os.readlink(path)!r}, which does "
                         f"not exist (is its disk mounted?); nothing was created")
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_dir():
        raise StoreError(f"store path {str(path)!r} is a regular file; give a folder path")
    lockfile.check_folder(path, OWNED)
    if not create and not os.path.lexists(path / "index.sqlite") and not os.path.lexists(path / "segments"):
        raise StoreError(f"no capsule store at {path} (pass create=True to make one)")
    return path


def holds_store(path: Path) -> bool:
    """Whether the folder holds a store's data (a non-empty index or a segment file). It looks
    (lstat), never follows: an index that is a link or no regular file counts as data, so the
    open refuses it by name (UnsafeStore) instead of taking the folder for a new store."""
    index = os.path.join(path, "index.sqlite")
    if os.path.lexists(index) and (os.path.islink(index) or not os.path.isfile(index)
                                   or os.lstat(index).st_size > 0):
        return True
    segments = os.path.join(path, "segments")
    return os.path.lexists(segments) and bool(os.path.islink(segments) or list_segment_files(Path(segments)))
