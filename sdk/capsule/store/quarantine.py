"""quarantine/: where recovery puts what it cannot use, instead of deleting it.

Recovery never deletes or truncates bytes it cannot prove were never committed. What it moves
aside goes into a new folder per event, `quarantine/<UTC time>-<what>/` (0700, files 0600):
an old index replaced by a rebuilt one, the unexplained bytes past a segment's committed end,
a segment file the index does not know, records a rebuild could not place. Each event folder
holds a REASON.txt. Nothing here is read by the store again; a person may inspect or delete it.

Threading: the caller holds the Store's writer lock (or the store is not open yet).
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Sequence

from . import fsafe
from .errors import StoreIOError, UnsafeStore
from .scan import Scanned, open_segment
from .segments import segment_path

FOLDER = "quarantine"
INDEX_FILES = ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "index.sqlite-journal")
_CHUNK = 8 << 20


def event_dir(path: Path, what: str) -> Path:
    """A new, empty event folder under path/quarantine (created 0700; never through a link)."""
    root = path / FOLDER
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(root).st_mode):
        raise StoreIOError(f"{root} is not a folder (a link or a file): recovery cannot set data aside; "
                           f"remove it and open the store again")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):
        target = root / (f"{stamp}-{what}" + (f"-{n}" if n else ""))
        try:
            os.mkdir(target, 0o700)
            return target
        except FileExistsError:
            continue
    raise StoreIOError(f"cannot make a new folder in {root}")


def write_file(folder: Path, name: str, data: bytes | memoryview) -> None:
    fd = fsafe.open_regular(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _done(folder: Path, reason: str) -> str:
    write_file(folder, "REASON.txt", (reason + "\n").encode())
    _fsync_dir(folder)
    _fsync_dir(folder.parent)
    return f"{reason}: set aside in {folder.parent.name}/{folder.name}/"


def save_tail(path: Path, segment: int, start: int, reason: str) -> str:
    """Copy the bytes of a segment from `start` to its end into quarantine (before a cut)."""
    folder = event_dir(path, f"tail-{segment:06d}")
    src = open_segment(segment_path(path / "segments", segment))
    try:
        size = os.fstat(src).st_size
        fd = fsafe.open_regular(folder / f"{segment:06d}.seg@{start}", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            pos = start
            while pos < size:
                chunk = os.pread(src, min(_CHUNK, size - pos), pos)
                if not chunk:
                    break
                os.write(fd, chunk)
                pos += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(src)
    return _done(folder, f"segment {segment:06d}: {size - start} bytes past its committed end {start} ({reason})")


def move_segment(path: Path, segment: int, reason: str) -> str:
    """Move a whole segment file the index does not hold into quarantine."""
    folder = event_dir(path, f"segment-{segment:06d}")
    src = segment_path(path / "segments", segment)
    os.rename(src, folder / src.name)
    _fsync_dir(path / "segments")
    return _done(folder, f"segment file {src.name} ({reason})")


def copy_records(path: Path, items: Sequence[tuple[Scanned, str]]) -> str:
    """Copy whole records (bytes as in the log) into quarantine: records.bin + records.json."""
    folder = event_dir(path, "records")
    listing, blobs, pos = [], [], 0
    for rec, why in items:
        fd = open_segment(segment_path(path / "segments", rec.segment))
        try:
            data = os.pread(fd, rec.length, rec.offset)
        finally:
            os.close(fd)
        blobs.append(data)
        listing.append({"at": pos, "length": len(data), "segment": rec.segment, "offset": rec.offset,
                        "kind": rec.kind, "epoch": rec.epoch, "region": rec.region, "index": rec.index,
                        "why": why})
        pos += len(data)
    write_file(folder, "records.bin", b"".join(blobs))
    write_file(folder, "records.json", json.dumps(listing, indent=1).encode())
    return _done(folder, f"{len(items)} records the rebuilt index cannot use")


def swap_index(path: Path, tmp: Path) -> None:
    """Make the synced file `tmp` the index; the old index files go into quarantine."""
    for extra in ("-wal", "-shm", "-journal"):
        if os.path.lexists(f"{tmp}{extra}"):
            raise StoreIOError(f"rebuilt index {tmp} left {tmp.name}{extra} behind; not swapped in")
    fd = fsafe.open_regular(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    old = [n for n in INDEX_FILES if os.path.lexists(path / n)]
    if old:
        folder = event_dir(path, "index")
        for name in old:
            os.rename(path / name, folder / name)
        _done(folder, "index files replaced by an index rebuilt from the segment log")
    os.rename(tmp, path / "index.sqlite")
    _fsync_dir(path)


def events(path: Path) -> list[tuple[str, str]]:
    """(folder name, first line of its REASON.txt) of every event in path/quarantine, oldest first."""
    root = path / FOLDER
    st = fsafe.lstat(root)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return []
    out = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = fsafe.open_regular(Path(entry.path) / "REASON.txt", os.O_RDONLY)
            try:
                reason = os.read(fd, 4096).decode("utf-8", "replace").splitlines()[0]
            finally:
                os.close(fd)
        except (OSError, IndexError, UnsafeStore):
            reason = "(no REASON.txt)"
        out.append((entry.name, reason))
    return out


def remove_leftover(tmp: Path) -> None:
    """Remove a temporary index a crashed rebuild left (it was never the index)."""
    for name in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal")):
        try:
            if stat.S_ISREG(os.lstat(name).st_mode) or stat.S_ISLNK(os.lstat(name).st_mode):
                os.unlink(name)
        except FileNotFoundError:
            pass


def _fsync_dir(folder: Path) -> None:
    fsafe.fsync_dir(folder)
