"""Segment files: the injectable FileOps, the append-only writer and bounds-checked reads.

Threading: a SegmentWriter is used by one thread at a time (the Store's writer lock).
A SegmentReader belongs to one read operation; the Store keeps files from being deleted
while it is in use.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from . import fsafe
from .errors import UnsafeStore
from .records import SEGMENT_HEADER, Buffer, RecordError, check_segment_header, segment_header

SEGMENT_NAME = re.compile(r"^(\d{6,9})\.seg$")
_DIRECT_WRITE = 256 << 10  # payloads this big skip the coalescing buffer (no extra copy)


def segment_path(folder: Path, segment: int) -> Path:
    return folder / f"{segment:06d}.seg"


def list_segment_files(folder: Path) -> dict[int, Path]:
    """Segment id -> path for every *.seg regular file in folder (other names are ignored).

    Refuses (UnsafeStore) what the store must never touch: folder not a real folder, a segment
    named link, or a highest-numbered segment entry that is no regular file (the writer appends to
    it, or deletes it as never committed). A lower one that is no regular file (a FIFO, a folder)
    is left out: reading it fails like any unreadable segment (PageCorrupt; verify reports it)."""
    fsafe.check_dir(folder)
    named = {int(m.group(1)): e for e in os.scandir(folder) if (m := SEGMENT_NAME.match(e.name))}
    for entry in named.values():
        if entry.is_symlink():
            raise fsafe.refusal(entry.path, stat.S_IFLNK)
    if named:
        fsafe.check_entry(named[max(named)].path)
    return {seg: Path(e.path) for seg, e in sorted(named.items()) if e.is_file(follow_symlinks=False)}


class FileOps:
    """The file operations of the write path, real by default. Tests subclass it to inject
    ENOSPC / EIO; every method raises OSError on failure."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """fsafe.open_regular: never a link, never blocking, a regular file only. A refusal is an
        OSError here too (ELOOP / EINVAL carrying UnsafeStore's message, which it chains), so the
        write path cuts and reports it like any failed write."""
        try:
            return fsafe.open_regular(path, flags, mode)
        except UnsafeStore as exc:
            code = errno.ELOOP if os.path.islink(path) else errno.EINVAL
            raise OSError(code, str(exc), path) from exc

    def write(self, fd: int, data: Buffer) -> None:
        """Write all of data (loops over short writes)."""
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]

    def fsync(self, fd: int) -> None:
        # fdatasync also persists the file size, which is all an append needs
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)

    def fsync_dir(self, path: str) -> None:
        # O_NOFOLLOW: a folder swapped for a link is refused (ELOOP), not synced through
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def close(self, fd: int) -> None:
        os.close(fd)


@dataclass(frozen=True)
class Position:
    """Where the next record goes: (segment, end offset). segment None: no segment file yet."""
    segment: int | None
    end: int


class SegmentWriter:
    """Appends records to the active segment, rotating to a new file past `segment_bytes`."""

    def __init__(self, folder: Path, fs: FileOps, segment_bytes: int, signed: bool):
        self._dir, self._fs, self._limit, self._signed = folder, fs, segment_bytes, signed
        self._seg: int | None = None
        self._end = 0
        self._next_seg = 1
        self._fds: dict[int, int] = {}      # open write fds
        self._ends: dict[int, int] = {}     # segments appended to since the last commit -> end
        self._created: list[int] = []       # files created since the last commit
        self._buf = bytearray()

    def attach(self, segment: int | None, end: int, next_segment: int) -> None:
        """Continue after the committed state: append at (segment, end), or start a new file.

        A segment whose header is damaged is not continued: every record appended to it would
        be unreadable (readers check the header first), so writes go to a new file instead.
        """
        self.abandon()
        if segment is not None and not _header_intact(self._dir, segment, self._signed):
            segment, end = None, 0
        self._seg, self._end, self._next_seg = segment, end, next_segment

    def position(self) -> Position:
        return Position(self._seg, self._end)

    def append(self, parts: Sequence[Buffer], length: int) -> tuple[int, int]:
        """Queue one record (its parts, `length` bytes in all); returns (segment, offset)."""
        if self._seg is None or (self._end > SEGMENT_HEADER.size and self._end + length > self._limit):
            self._rotate()
        seg, offset = self._seg, self._end
        for part in parts:
            if len(part) >= _DIRECT_WRITE:
                self.flush()
                self._fs.write(self._fd(seg), part)
            else:
                self._buf += part
        self._end += length
        self._ends[seg] = self._end
        if len(self._buf) >= _DIRECT_WRITE:
            self.flush()
        return seg, offset

    def flush(self) -> None:
        """Hand buffered bytes to the OS (no fsync)."""
        if self._buf and self._seg is not None:
            data, self._buf = self._buf, bytearray()
            self._fs.write(self._fd(self._seg), data)

    def sync(self) -> dict[int, int]:
        """flush + fsync every segment written since the last commit (+ the folder if a file was
        created). Returns segment -> end, the committed ends to record in the index."""
        self.flush()
        for seg in self._ends:
            self._fs.fsync(self._fd(seg))
        if self._created:
            self._fs.fsync_dir(str(self._dir))
        return dict(self._ends)

    def committed(self) -> None:
        """The index now holds everything synced: forget pending state, close sealed files."""
        self._ends.clear()
        self._created.clear()
        for seg in [s for s in self._fds if s != self._seg]:
            self._fs.close(self._fds.pop(seg))

    def rollback_to(self, pos: Position) -> None:
        """Drop everything appended after pos (files created since are unlinked). OSError if not possible."""
        self._buf = bytearray()
        for seg in [s for s in self._created if pos.segment is None or s > pos.segment]:
            fd = self._fds.pop(seg, None)
            if fd is not None:
                self._fs.close(fd)
            self._fs.unlink(str(segment_path(self._dir, seg)))
            self._created.remove(seg)
            self._ends.pop(seg, None)
            self._next_seg = min(self._next_seg, seg)
        self._seg, self._end = pos.segment, pos.end
        if pos.segment is not None:
            self._fs.truncate(self._fd(pos.segment), pos.end)
            if pos.segment in self._ends:
                self._ends[pos.segment] = pos.end

    def abandon(self) -> None:
        """Close every fd and forget pending state without any other I/O (errors ignored)."""
        self._buf = bytearray()
        for fd in self._fds.values():
            try:
                self._fs.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._ends.clear()
        self._created.clear()

    def _fd(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            fd = self._fds[seg] = self._fs.open(str(segment_path(self._dir, seg)), os.O_WRONLY | os.O_APPEND)
        return fd

    def _rotate(self) -> None:
        self.flush()
        seg = self._next_seg
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        fd = self._fs.open(str(segment_path(self._dir, seg)), flags)
        self._fds[seg] = fd
        self._created.append(seg)
        self._next_seg = seg + 1
        if self._seg is not None and self._seg not in self._ends and self._seg in self._fds:
            self._fs.close(self._fds.pop(self._seg))  # sealed and not written since the last commit
        self._seg, self._end = seg, SEGMENT_HEADER.size
        self._ends[seg] = self._end
        self._buf += segment_header(seg, self._signed)


def _header_intact(folder: Path, segment: int, signed: bool) -> bool:
    try:
        fd = fsafe.open_regular(segment_path(folder, segment), os.O_RDONLY)
        try:
            check_segment_header(os.pread(fd, SEGMENT_HEADER.size, 0), segment, signed)
        finally:
            os.close(fd)
    except (OSError, RecordError, UnsafeStore):
        return False  # a link or no regular file is not continued either: writes go to a new file
    return True


class SegmentReader:
    """Read-only access to committed bytes for one operation; use as a context manager."""

    def __init__(self, folder: Path, signed: bool):
        self._dir, self._signed = folder, signed
        self._files: dict[int, tuple[int, int]] = {}  # segment -> (fd, size)
        self._maps: dict[int, mmap.mmap] = {}

    def __enter__(self) -> "SegmentReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def size(self, segment: int) -> int:
        return self._open(segment)[1]

    def read(self, segment: int, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at offset, after checking the range against the file size."""
        fd, size = self._open(segment)
        if offset < SEGMENT_HEADER.size or length <= 0 or offset + length > size:
            size = os.fstat(fd).st_size  # a file still being appended to may have grown
            self._files[segment] = (fd, size)
            if offset < SEGMENT_HEADER.size or length <= 0 or offset + length > size:
                raise RecordError(f"range {offset}+{length} lies outside segment {segment:06d} ({size} bytes; "
                                  f"torn tail or truncated file)")
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise RecordError(f"short read at {offset} in segment {segment:06d} (file shrank?)")
        return data

    def view(self, segment: int, offset: int, length: int) -> memoryview:
        """Like read, but a zero-copy view of a read-only map of the file (bulk epoch loads).

        The map is released when the last view is dropped, not at close(): restore hands the
        views on, and copying 100s of MB out of the page cache first would double the cost.
        """
        fd, size = self._open(segment)
        if offset < SEGMENT_HEADER.size or length <= 0 or offset + length > size:
            self.read(segment, offset, length)          # refreshes the size or raises RecordError
            fd, size = self._files[segment]
            self._maps.pop(segment, None)
        mapped = self._maps.get(segment)
        if mapped is None:
            mapped = self._maps[segment] = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        return memoryview(mapped)[offset:offset + length]

    def close(self) -> None:
        self._maps.clear()   # views still held elsewhere keep their map alive
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def _open(self, segment: int) -> tuple[int, int]:
        got = self._files.get(segment)
        if got is not None:
            return got
        try:
            fd = fsafe.open_regular(segment_path(self._dir, segment), os.O_RDONLY)
        except FileNotFoundError:
            raise RecordError(f"segment file {segment:06d}.seg is missing") from None
        except UnsafeStore as exc:  # a link, FIFO or folder is unreadable, like any damaged segment
            raise RecordError(f"segment file {segment:06d}.seg cannot be read: {exc}") from None
        try:
            check_segment_header(os.pread(fd, SEGMENT_HEADER.size, 0), segment, self._signed)
        except RecordError:
            os.close(fd)
            raise
        self._files[segment] = got = (fd, os.fstat(fd).st_size)
        return got
