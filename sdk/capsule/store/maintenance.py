"""Retention, compaction, verification and statistics over a store's index and segments.

Functions, not methods: the Store takes its locks and hands in the parts. Compaction is
crash-safe at every point: copies land past the committed end until the index commit
repoints the rows, and old files are deleted only after that commit (a crash in between
leaves their rows marked 'dead', and the next open deletes them).
"""
from __future__ import annotations

import threading
from pathlib import Path

from . import keyeddb
from .keyedrows import location_damage
from .index import Index
from .info import Head, PageRef, VerifyReport
from .errors import IndexStale, PageCorrupt
from .reader import check_record, check_ref, check_view, read_manifest
from .records import (KIND_EPOCH, KIND_MANIFEST, RECORD_HEADER, SEGMENT_HEADER, RecordError, Sealer,
                      decode_record, parse_header)
from .segments import FileOps, SegmentReader, SegmentWriter, list_segment_files, segment_path


def retain(index: Index, keep: int) -> int:
    """Drop unnamed epochs older than the `keep` newest, and the page rows nobody sees any more.
    Keyed records belong to no epoch: retention never touches them."""
    infos = index.epochs()
    dropped = [e.id for e in infos[:-keep] if e.name is None]
    if dropped:
        index.drop_epochs(dropped)
    return len(dropped)


def delete_dead_segments(index: Index, fs: FileOps, folder: Path) -> None:
    """Finish an interrupted compaction: unlink files whose rows are marked dead, then forget them."""
    dead = list(index.segments("dead"))
    gone = []
    for seg in dead:
        try:
            fs.unlink(str(segment_path(folder, seg)))
        except FileNotFoundError:
            pass
        except OSError:
            continue  # retried at the next open / compaction
        gone.append(seg)
    if gone:
        try:
            fs.fsync_dir(str(folder))
        except OSError:
            return  # rows stay 'dead': the next open unlinks (no-op) and forgets them
        index.forget_segments(gone)


def compact(index: Index, writer: SegmentWriter, fs: FileOps, folder: Path, sealer: Sealer,
            lock: threading.RLock, threshold: float) -> int:
    """Copy live records of sealed, mostly dead segments to the active one; returns bytes reclaimed.
    The caller holds the writer lock and has no staged epochs; OSError / StoreError propagate
    (the caller then cuts the uncommitted copies)."""
    with lock:
        live = index.segments("live")
        usage: dict[int, int] = {}
        for seg, _, length in index.live_records():
            usage[seg] = usage.get(seg, 0) + length
    active = writer.position().segment
    victims = [s for s, end in live.items()
               if s != active and usage.get(s, 0) < threshold * max(1, end - SEGMENT_HEADER.size)]
    if not victims:
        return 0
    moves: dict[tuple[int, int], tuple[int, int]] = {}
    done, copied = [], 0
    head: Head | None = None
    with SegmentReader(folder, sealer.signed) as segs:
        for seg in victims:
            with lock:
                records = index.live_records(seg)
            try:  # verify a whole segment before copying any of it: bad bytes are never copied
                blobs = [(off, segs.read(seg, off, length)) for _, off, length in records]
                for _, blob in blobs:
                    decode_record(blob, sealer)
            except RecordError:
                continue  # damaged: left in place for `verify` to report
            for off, blob in blobs:
                moves[(seg, off)] = at = writer.append((blob,), len(blob))
                head = Head(at[0], at[1], len(blob), blob[len(blob) - sealer.tag_bytes:])  # the log's new end
                copied += len(blob)
            done.append(seg)
    sizes = {s: segment_path(folder, s).stat().st_size for s in done}  # read above: they exist
    ends = writer.sync()
    with lock:
        index.repoint(moves, ends, done, head)  # the commit point of compaction
        writer.committed()
        delete_dead_segments(index, fs, folder)
    return max(0, sum(sizes.values()) - copied)


def verify(index: Index, folder: Path, sealer: Sealer) -> VerifyReport:
    """Scan every committed record of every segment, then check every epoch's index rows."""
    problems: list[str] = []
    scanned: dict[tuple[int, int], tuple] = {}  # location -> (kind, epoch, region, index, length)
    tags: dict[tuple[int, int], bytes] = {}
    records = nbytes = 0
    live = index.segments("live")
    files = list_segment_files(folder)
    with SegmentReader(folder, sealer.signed) as segs:
        for seg, end in live.items():
            try:
                size = segs.size(seg)
            except RecordError as exc:
                problems.append(f"segment {seg:06d}: {exc}")
                continue
            if size < end:
                problems.append(f"segment {seg:06d} is {size} bytes but {end} are committed (truncated)")
            off, limit = SEGMENT_HEADER.size, min(size, end)
            while off < limit:
                try:
                    total = parse_header(segs.read(seg, off, min(RECORD_HEADER.size, limit - off))).total
                    if off + total > limit:
                        raise RecordError(f"record of {total} bytes runs past the committed end {limit}")
                    head, region, _ = decode_record(segs.read(seg, off, total), sealer)
                except RecordError as exc:
                    problems.append(f"segment {seg:06d} offset {off}: {exc}; the next {limit - off} bytes "
                                    f"are not scanned")
                    break
                scanned[(seg, off)] = (head.kind, head.epoch, region, head.index, total)
                tags[(seg, off)] = segs.read(seg, off + total - sealer.tag_bytes, sealer.tag_bytes)
                records, nbytes, off = records + 1, nbytes + total, off + total
        problems += [f"segment file {files[s].name} is not in the index (left over; safe to move away)"
                     for s in files if s not in live and s < max(live, default=0)]
        epochs_ok, epochs_bad = [], []
        for epoch in index.epoch_ids():
            manifest = index.manifest_ref(epoch)
            refs = ([manifest] if manifest else []) + index.view(epoch)
            reasons = [(ref, _check(segs, sealer, ref, scanned)) for ref in refs]
            first = next(((ref, why) for ref, why in reasons if why), None)
            if first is None and manifest is not None:
                why = _against_envelope(segs, sealer, manifest, index.view(epoch), epoch, tags)
                if why:
                    first = (manifest, why)
            if first is None:
                epochs_ok.append(epoch)
                continue
            epochs_bad.append(epoch)
            ref, why = first
            what = "manifest" if ref.region is None else f"page {ref.region}[{ref.index}]"
            problems.append(f"epoch {epoch}: {what} (segment {ref.segment}, offset {ref.offset}): {why}")
        records_bad: list[tuple[str, int]] = []
        for ref in keyeddb.locations(index):
            why = location_damage(ref.segment, ref.offset, ref.length) or _check(segs, sealer, ref, scanned)
            if why:
                records_bad.append((ref.region, ref.index))  # type: ignore[arg-type]
                problems.append(f"{ref.region} {ref.index}: record version {ref.rec_epoch} (segment {ref.segment}, "
                                f"offset {ref.offset}): {why}")
        for coll, rid, why in keyeddb.row_damage(index):   # rows that are not JSON objects at all
            if (coll, rid) not in records_bad:
                records_bad.append((coll, rid))
            problems.append(f"{coll} {rid}: index row: {why}")
    problems += index.integrity_problems()
    return VerifyReport(not problems, tuple(epochs_ok), tuple(epochs_bad), records, nbytes, tuple(problems),
                        tuple(records_bad))


def _against_envelope(segs: SegmentReader, sealer: Sealer, manifest: PageRef, view: list[PageRef], epoch: int,
                      tags: dict[tuple[int, int], bytes]) -> str:
    """'' when the epoch's index rows name exactly the records its envelope lists (or it has none)."""
    try:
        env = read_manifest(segs, sealer, manifest, epoch).envelope
        if env is None:
            return ""
        check_view(view, env.listing, epoch)
    except (PageCorrupt, IndexStale) as exc:
        return f"{exc}; `capsule repair` rebuilds the index from the segment log"
    for ref in view:
        if tags.get(ref.location) != env.listing[ref.region][ref.index][1]:  # type: ignore[index]
            return (f"the index points page {ref.region}[{ref.index}] at a record its envelope does not list; "
                    f"`capsule repair` rebuilds the index from the segment log")
    return ""


def _check(segs: SegmentReader, sealer: Sealer, ref: PageRef, scanned: dict[tuple[int, int], tuple]) -> str:
    """'' when the record at ref is valid and is the record the row expects, else why not."""
    seen = scanned.get((ref.segment, ref.offset))  # type: ignore[arg-type]
    if seen is not None:
        want = (ref.record_kind, ref.rec_epoch, ref.region or "", ref.index or 0, ref.length)
        if ref.record_kind == KIND_MANIFEST and seen[0] == KIND_EPOCH:
            want = (KIND_EPOCH, *want[1:])   # an enveloped manifest stands where a bare one did
        return "" if seen == want else f"the record there is {seen}, the index expects {want}"
    try:  # not reached by the scan (it stopped at damage earlier in the segment)
        check_ref(ref)
        check_record(segs.read(ref.segment, ref.offset, ref.length), ref, sealer)  # type: ignore[arg-type]
        return ""
    except RecordError as exc:
        return str(exc)


def stats(index: Index, path: Path) -> dict[str, int | None]:
    live = index.segments("live")
    seg_bytes = sum(p.stat().st_size for p in list_segment_files(path / "segments").values())
    index_bytes = sum(p.stat().st_size for p in path.glob("index.sqlite*") if p.is_file())
    return {"segments": len(live), "segment_bytes": seg_bytes, "bytes_on_disk": seg_bytes + index_bytes,
            "live_bytes": sum(length for _, _, length in index.live_records()),
            "epochs": len(index.epoch_ids()), "latest": index.latest(), "records": keyeddb.count(index)}
