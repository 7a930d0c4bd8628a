"""The way back to the committed state: make the segment files match the index, cutting every
byte the index does not know about (after a failed write, a discarded batch, or a crash).

Threading: called with the Store's writer lock held; takes the state lock around the index read.
"""
from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from .index import Index
from .records import SEGMENT_HEADER
from .segments import FileOps, SegmentWriter, list_segment_files, segment_path


def reset_to_committed(writer: SegmentWriter, index: Index, lock: threading.RLock, fs: FileOps,
                       seg_dir: Path) -> None:
    """With the writer abandoned: delete never-committed segment files, cut the active segment past
    its committed end, and append after it (or in a fresh file when committed bytes are missing:
    never write over what the index points at)."""
    with lock:
        live = index.segments("live")
    top = max(live, default=0)
    orphans = [s for s in list_segment_files(seg_dir) if s > top]
    for seg in orphans:
        fs.unlink(str(segment_path(seg_dir, seg)))
    if orphans:
        fs.fsync_dir(str(seg_dir))
    if not top:
        return writer.attach(None, 0, 1)
    end, path = live[top], segment_path(seg_dir, top)
    size = path.stat().st_size if path.exists() else -1
    if size > end:
        fd = fs.open(str(path), os.O_WRONLY)
        try:
            fs.truncate(fd, end)
            fs.fsync(fd)
        finally:
            fs.close(fd)
    ok = size >= end >= SEGMENT_HEADER.size
    writer.attach(top if ok else None, end if ok else 0, top + 1)


def reason(exc: BaseException | None) -> str:
    """An OS error as 'ENOSPC: No space left on device'; anything else as its text."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror or exc}"
    return str(exc)
