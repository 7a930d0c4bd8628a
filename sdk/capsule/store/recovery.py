"""Recovery at open: is the index still the log's cache, and what lies past the committed end?

check_index compares the index with the log in O(1): the index records the log's head (the
last record committed: where, and its tag); a head that is not where the segment list says, or
not the record there, or a last commit newer than the index's newest epoch, means the index
lost commits or was damaged: rebuild it from the log (rebuild.py).

settle_tail looks at every byte past the committed end (the active segment's tail, segment
files above the highest one indexed) and sorts each valid record found there:
- uncommitted: pages of an epoch after the newest, or exact copies of records the index holds
  (an interrupted compaction) — the bytes of a write that never committed; they are cut;
- lost: an epoch envelope, keyed or forget record the index lacks, or a copy the index cannot
  match — proof that commits were lost (a damaged WAL, say): the index must be rebuilt, which
  adopts them; nothing is cut;
and the bytes that are not valid records: a torn write (a record cut short by the end of the
file, or zeros) is cut; anything else is moved into quarantine/ first (quarantine.py). So
recovery never deletes bytes it cannot prove were never committed.

Threading: called from Store.open / repair with the LOCK held and no other user of the store.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import quarantine
from .adopt import adopt_tail
from .index import Index
from .records import (KIND_EPOCH, KIND_FORGET, KIND_RECORD, KIND_MANIFEST, KIND_PAGE, RECORD_HEADER,
                      SEGMENT_HEADER, STORE_FORMAT_VERSION, RecordError, Sealer, decode_record, parse_header)
from .scan import GARBAGE, Scanned, SegmentScan, scan_segment, open_segment
from .segments import FileOps, list_segment_files, segment_path

UNCOMMITTED, LOST, UNEXPLAINED = "uncommitted", "lost", "unexplained"


def check_index(index: Index, seg_dir: Path, sealer: Sealer) -> str | None:
    """Why the index is not a faithful cache of the log (None: it is, as far as O(1) can tell)."""
    live = index.segments("live")
    top = max(live, default=0)
    head = index.head()
    if head is None:
        written = top and live[top] > SEGMENT_HEADER.size
        fmt = index.get_meta().get("format_version")
        return "the index names no log head" if written and fmt == str(STORE_FORMAT_VERSION) else None
    if head.segment != top or head.end != live[top]:
        return (f"the index's log head (segment {head.segment}, end {head.end}) is not the end of its newest "
                f"segment ({top}, {live.get(top)})")
    try:
        kind, epoch, tag = _record_at(seg_dir, head.segment, head.offset, head.length, len(head.tag))
    except (OSError, RecordError):
        return None   # the log lost or damaged its last bytes: the index is right, reads report it
    if tag != head.tag:
        if not _verifies(seg_dir, sealer, head.segment, head.offset, head.length):
            return None   # damaged bytes where the index says: segment damage, reads report it
        return "the log's head record is another record than the one the index names"
    latest = index.latest() or 0
    if kind in (KIND_EPOCH, KIND_MANIFEST) and epoch > latest:
        return f"the log's last commit is epoch {epoch}, the index's newest epoch is {latest or 'none'}"
    return None


def settle_tail(path: Path, index: Index, sealer: Sealer, fs: FileOps, *, after_rebuild: bool,
                adopted: bool = False) -> tuple[str | None, list[str]]:
    """(why the index must be rebuilt, or None; report lines). Cuts what is provably uncommitted,
    quarantines what is unexplained. Commits the index lacks are first adopted from the tail
    (adopt.py); when that is not possible, nothing is changed and the index must be rebuilt
    (unless it was just rebuilt: then what it could not adopt is quarantined)."""
    seg_dir = path / "segments"
    live = index.segments("live")
    top = max(live, default=0)
    files = list_segment_files(seg_dir)
    tails: list[tuple[SegmentScan, bool]] = []          # (scan, whole file)
    if top in files and os.lstat(files[top]).st_size > live[top]:
        tails.append((scan_segment(seg_dir, top, sealer, start=live[top]), False))
    tails += [(scan_segment(seg_dir, seg, sealer), True) for seg in sorted(files) if seg > top]
    latest = index.latest() or 0
    verdicts = [_classify(index, seg_dir, sealer, scan, latest) for scan, _ in tails]
    lost = [scan for (scan, _), (v, _) in zip(tails, verdicts) if v == LOST]
    if lost and not after_rebuild:
        if not adopted:
            lines = adopt_tail(seg_dir, index, sealer, index.get_meta()["store_id"], [scan for scan, _ in tails])
            if lines is not None:
                why, more = settle_tail(path, index, sealer, fs, after_rebuild=False, adopted=True)
                return why, lines + more
        return (f"segment {lost[0].segment:06d} holds records the index lacks, written completely before "
                f"the last stop (an interrupted commit, or a damaged index): "
                f"{next(why for v, why in verdicts if v == LOST)}"), []
    report, removed = [], False
    for (scan, whole), (verdict, why) in zip(tails, verdicts):
        if whole:
            if verdict == UNCOMMITTED:
                fs.unlink(str(segment_path(seg_dir, scan.segment)))
            else:
                report.append(quarantine.move_segment(path, scan.segment, why))
            removed = True
            continue
        if verdict != UNCOMMITTED:
            report.append(quarantine.save_tail(path, scan.segment, scan.start, why))
        fd = fs.open(str(segment_path(seg_dir, scan.segment)), os.O_WRONLY)
        try:
            fs.truncate(fd, scan.start)
            fs.fsync(fd)
        finally:
            fs.close(fd)
    if removed:
        fs.fsync_dir(str(seg_dir))
    return None, report


def _classify(index: Index, seg_dir: Path, sealer: Sealer, scan: SegmentScan, latest: int) -> tuple[str, str]:
    if scan.header_error:
        return UNEXPLAINED, f"its header is damaged: {scan.header_error}"
    for rec in scan.records:
        if rec.kind == KIND_PAGE and rec.epoch > latest:
            continue                                    # pages of an epoch that never committed
        if (rec.kind in (KIND_EPOCH, KIND_MANIFEST) and rec.epoch > latest) or not _is_copy(index, seg_dir, rec):
            return LOST, f"a {_KIND_NAMES.get(rec.kind, rec.kind)} record of epoch/version {rec.epoch}, index " \
                         f"{rec.index} at offset {rec.offset}"
    if scan.skipped:
        off, n, why = scan.skipped[0]
        return UNEXPLAINED, f"{n} unreadable bytes at offset {off} ({why})"
    if scan.tail == GARBAGE:
        return UNEXPLAINED, f"unreadable bytes at offset {scan.end}"
    return UNCOMMITTED, "an interrupted write"


_KIND_NAMES = {KIND_PAGE: "page", KIND_MANIFEST: "manifest", KIND_EPOCH: "epoch", KIND_RECORD: "keyed record",
               KIND_FORGET: "forget"}
_WHERE = {KIND_PAGE: ("SELECT segment, offset, length FROM pages WHERE region = ? AND idx = ? AND rec_epoch = ? "
                      "AND segment IS NOT NULL", lambda r: (r.region, r.index, r.epoch)),
          KIND_EPOCH: ("SELECT man_segment, man_offset, man_length FROM epochs WHERE id = ?", lambda r: (r.epoch,)),
          KIND_MANIFEST: ("SELECT man_segment, man_offset, man_length FROM epochs WHERE id = ?",
                          lambda r: (r.epoch,)),
          KIND_RECORD: ("SELECT segment, offset, length FROM records WHERE collection = ? AND id = ? AND version = ?",
                        lambda r: (r.region, r.index, r.epoch)),
          KIND_FORGET: ("SELECT segment, offset, length FROM forgotten WHERE collection = ? AND id = ?",
                        lambda r: (r.region, r.index))}


def _is_copy(index: Index, seg_dir: Path, rec: Scanned) -> bool:
    """Whether the index holds a record identical to rec elsewhere (rec is then a spare copy)."""
    sql, args = _WHERE[rec.kind]
    for seg, off, length in index.query(sql, args(rec)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seg, off, length)):
            continue
        if (seg, off) == (rec.segment, rec.offset) or length != rec.length:
            continue
        try:
            kind, epoch, tag = _record_at(seg_dir, seg, off, length, len(rec.tag))
        except (OSError, RecordError):
            continue
        if (kind, epoch, tag) == (rec.kind, rec.epoch, rec.tag):
            return True
    return False


def _verifies(seg_dir: Path, sealer: Sealer, segment: int, offset: int, length: int) -> bool:
    """Whether a whole, intact record lies at the location (its own tag checks out)."""
    try:
        fd = open_segment(segment_path(seg_dir, segment))
        try:
            decode_record(os.pread(fd, length, offset), sealer)
        finally:
            os.close(fd)
    except (OSError, RecordError):
        return False
    return True


def _record_at(seg_dir: Path, segment: int, offset: int, length: int, tag_len: int) -> tuple[int, int, bytes]:
    """(kind, epoch, tag) of the record at a location, read without reading its payload."""
    if offset < SEGMENT_HEADER.size or length < RECORD_HEADER.size + tag_len:
        raise RecordError("impossible record location")
    fd = open_segment(segment_path(seg_dir, segment))
    try:
        head = os.pread(fd, RECORD_HEADER.size, offset)
        tag = os.pread(fd, tag_len, offset + length - tag_len)
    finally:
        os.close(fd)
    parsed = parse_header(head)
    if parsed.total != length or len(tag) != tag_len:
        raise RecordError("the record there has another length")
    return parsed.kind, parsed.epoch, tag

