"""Reading the log without the index: every record of a segment file, in order, each verified.

Records carry their own identity (kind, epoch, region, page index) and tag, so a scan alone
says what the log holds. After damage the scan resynchronizes on the next record magic whose
record verifies, so one flipped byte costs one record, not the rest of the file. What follows
the last valid record is classified: nothing, a torn write (a record cut short by the end of
the file, or zeros: what a crash mid-append leaves), or unexplained bytes.

Threading: pure reads of one file; the caller holds the Store's locks.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import fsafe
from .errors import UnsafeStore
from .records import (RECORD_HEADER, RECORD_MAGIC, SEGMENT_HEADER, RecordError, Sealer, check_segment_header,
                      decode_record, parse_header)
from .segments import segment_path

CLEAN, TORN, GARBAGE = "clean", "torn", "garbage"


@dataclass(frozen=True)
class Scanned:
    """One valid record found in the log."""
    segment: int
    offset: int
    length: int
    kind: int
    epoch: int
    region: str
    index: int
    tag: bytes

    @property
    def identity(self) -> tuple[int, int, str, int]:
        return self.kind, self.epoch, self.region, self.index


@dataclass
class SegmentScan:
    segment: int
    size: int
    start: int
    header_error: str | None = None
    records: list[Scanned] = field(default_factory=list)
    end: int = 0                                  # end of the last valid record (or start)
    skipped: list[tuple[int, int, str]] = field(default_factory=list)   # (offset, bytes, why) resynced over
    tail: str = CLEAN                             # what lies in [end, size)

    @property
    def damaged(self) -> bool:
        return bool(self.header_error or self.skipped or self.tail == GARBAGE)


def scan_segment(folder: Path, segment: int, sealer: Sealer, start: int | None = None) -> SegmentScan:
    """Scan one segment file from `start` (a record boundary; default: just after the header)."""
    path = segment_path(folder, segment)
    fd = open_segment(path)
    try:
        size = os.fstat(fd).st_size
        first = SEGMENT_HEADER.size if start is None else start
        out = SegmentScan(segment, size, first, end=first)
        try:
            check_segment_header(os.pread(fd, SEGMENT_HEADER.size, 0), segment, sealer.signed)
        except RecordError as exc:
            out.header_error = str(exc)
            out.end = 0
            return out
        if size <= first:
            return out
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as data:
            _records(memoryview(data), data, out, sealer)
        return out
    finally:
        os.close(fd)


def payload(folder: Path, rec: Scanned, sealer: Sealer) -> bytes:
    """The verified payload of a scanned record (read again: scans keep no payloads)."""
    fd = open_segment(segment_path(folder, rec.segment))
    try:
        buf = os.pread(fd, rec.length, rec.offset)
    finally:
        os.close(fd)
    if len(buf) != rec.length:
        raise RecordError(f"segment {rec.segment:06d} shrank under the scan")
    head, _, body = decode_record(buf, sealer)
    if (head.kind, head.epoch, head.index) != (rec.kind, rec.epoch, rec.index):
        raise RecordError(f"segment {rec.segment:06d} changed under the scan")
    return bytes(body)


def _records(view: memoryview, data: mmap.mmap, out: SegmentScan, sealer: Sealer) -> None:
    size, pos = len(view), out.start
    while pos < size:
        rec, why = _record_at(view, pos, out.segment, sealer)
        if rec is not None:
            out.records.append(rec)
            pos = out.end = pos + rec.length
            continue
        nxt = _resync(view, data, pos + 1, out.segment, sealer)
        if nxt is None:
            out.tail = _tail_kind(view, pos, why)
            return
        out.skipped.append((pos, nxt - pos, why))
        pos = nxt
    out.tail = CLEAN


def _record_at(view: memoryview, pos: int, segment: int, sealer: Sealer) -> tuple[Scanned | None, str]:
    try:
        head = parse_header(view[pos:pos + RECORD_HEADER.size])
        if pos + head.total > len(view):
            return None, f"record of {head.total} bytes runs past the end of the file"
        rec = view[pos:pos + head.total]
        head, region, _ = decode_record(rec, sealer)
    except RecordError as exc:
        return None, str(exc)
    return Scanned(segment, pos, head.total, head.kind, head.epoch, region, head.index,
                   bytes(rec[head.total - sealer.tag_bytes:])), ""


def _resync(view: memoryview, data: mmap.mmap, pos: int, segment: int, sealer: Sealer) -> int | None:
    """The offset of the next valid record after damage at pos - 1, if any."""
    while True:
        pos = data.find(RECORD_MAGIC, pos)
        if pos < 0:
            return None
        if _record_at(view, pos, segment, sealer)[0] is not None:
            return pos
        pos += 1


def _tail_kind(view: memoryview, pos: int, why: str) -> str:
    """What [pos, end) is when no valid record starts there or after: TORN for what an append
    cut short by a crash leaves (zeros, or a record header claiming more than the file holds),
    GARBAGE for anything else."""
    rest = view[pos:]
    if not any(rest):                     # zero-filled: the size was persisted, the data was not
        return TORN
    if len(rest) < RECORD_HEADER.size:
        return TORN if bytes(rest[:4]) == RECORD_MAGIC[:min(4, len(rest))] else GARBAGE
    try:
        head = parse_header(rest[:RECORD_HEADER.size])
    except RecordError:
        return GARBAGE
    return TORN if pos + head.total > len(view) else GARBAGE


def open_segment(path: Path) -> int:
    """A segment for reading: never through a link, never a FIFO or a folder (RecordError)."""
    try:
        return fsafe.open_regular(path, os.O_RDONLY)
    except (OSError, UnsafeStore) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise RecordError(f"segment file {path.name} cannot be read ({why})") from None
