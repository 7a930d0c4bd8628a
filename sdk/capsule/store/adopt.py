"""Rolling the index forward over the log's tail: what a crash between the fsync and the index
commit leaves (complete epochs, keyed records and forgets whose records are durable, never committed).

A process that dies in that window is common (the commit is an fsync of its own), and a whole-log
rebuild for it would make every such restart O(history). The tail alone says what to add: each
envelope lists its view, so an epoch right after the index's newest whose new pages are in the
tail, and whose other pages are the ones the index already holds (by identity and tag), is
committed as the writer would have; keyed and forget records carry their rows. Anything else
(a gap in epoch numbers, another store's record, a listed record found nowhere) returns None and
the caller rebuilds the index from the whole log instead.

Threading: called from Store.open's recovery, the LOCK held, no other user of the store.
"""
from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from .. import safejson
from . import envelope, keyeddb, keyedrecord
from .deltas import listing_of
from .envelope import Envelope, Listing
from .errors import StoreError
from .index import Index
from .pagemap import insert_epochs
from .info import EpochInfo, Head, PageRef, StagedEpoch
from .records import KIND_EPOCH, KIND_FORGET, KIND_PAGE, KIND_RECORD, RecordError, Sealer
from .scan import Scanned, SegmentScan, open_segment, payload
from .segments import Position, segment_path


@dataclass
class _Plan:
    staged: list[StagedEpoch] = field(default_factory=list)
    records: list[tuple[Scanned, keyedrecord.Head]] = field(default_factory=list)
    forgets: list[Scanned] = field(default_factory=list)
    last: Scanned | None = None          # the last record adopted (the log's new head)


def adopt_tail(seg_dir: Path, index: Index, sealer: Sealer, store_id: str,
               tails: list[SegmentScan]) -> list[str] | None:
    """Commit the tail's complete epochs, keyed records and forgets into the index in one transaction;
    report lines, or None when the tail cannot be adopted record by record (rebuild instead)."""
    try:
        plan = _plan(seg_dir, index, sealer, store_id, tails)
    except (RecordError, StoreError):
        return None
    if plan is None or plan.last is None:
        return None
    ends = _ends(index, plan)
    for seg in ends:   # adopted records must be durable before the index says they are committed
        fd = open_segment(segment_path(seg_dir, seg))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    head = Head(plan.last.segment, plan.last.offset, plan.last.length, plan.last.tag)
    index.write("adopting the log's tail", lambda c: _apply(c, plan), ends, head)
    lines = []
    if plan.staged:
        ids = [s.info.id for s in plan.staged]
        lines.append(f"epoch(s) {', '.join(map(str, ids))} complete in the log but not committed when the "
                     f"process stopped: adopted")
    if plan.records or plan.forgets:
        lines.append(f"{len(plan.records)} keyed record write(s) and {len(plan.forgets)} forget(s) complete in the log "
                     f"but not committed when the process stopped: adopted")
    return lines


def _plan(seg_dir: Path, index: Index, sealer: Sealer, store_id: str, tails: list[SegmentScan]) -> _Plan | None:
    latest = index.latest() or 0
    prev: Listing | None = None
    pages: dict[tuple[int, str, int], list[Scanned]] = {}
    plan = _Plan()
    for rec in (r for scan in tails for r in scan.records):
        if rec.kind == KIND_PAGE:
            pages.setdefault((rec.epoch, rec.region, rec.index), []).append(rec)
            continue
        if rec.kind == KIND_EPOCH:
            env = envelope.decode(payload(seg_dir, rec, sealer), sealer.tag_bytes)
            if env.epoch != latest + 1 or env.store_id != store_id:
                return None
            if prev is None:
                prev = _listing(seg_dir, index, sealer, latest)
            rows = _rows(index, seg_dir, sealer, env, prev, pages)
            if rows is None:
                return None
            plan.staged.append(StagedEpoch(
                EpochInfo(env.epoch, env.name, env.created, env.page_bytes + rec.length, env.n_pages, env.meta,
                          env.base), PageRef(None, None, env.epoch, rec.segment, rec.offset, rec.length),
                tuple(rows), Position(None, 0)))
            latest, prev = env.epoch, env.listing
        elif rec.kind == KIND_RECORD:
            head, _ = keyedrecord.decode(payload(seg_dir, rec, sealer))
            if head is None or head.store_id != store_id:
                return None
            plan.records.append((rec, head))
        elif rec.kind == KIND_FORGET:
            forget = safejson.loads(payload(seg_dir, rec, sealer), what="forget record", max_bytes=4096)
            if not isinstance(forget, dict) or forget.get("store") != store_id:
                return None
            plan.forgets.append(rec)
        else:
            return None            # a bare manifest: an older SDK's, never written by this one
        plan.last = rec
    return plan


def _listing(seg_dir: Path, index: Index, sealer: Sealer, epoch: int) -> Listing:
    if epoch == 0:
        return {}
    ref = index.manifest_ref(epoch)
    if ref is None:
        raise StoreError(f"epoch {epoch} has no manifest row")
    return listing_of(seg_dir, sealer, index, ref, epoch)


def _rows(index: Index, seg_dir: Path, sealer: Sealer, env: Envelope, prev: Listing,
          pages: dict[tuple[int, str, int], list[Scanned]]) -> list[PageRef] | None:
    """The rows that turn prev's view into env's, every listed record found (else None)."""
    rows = []
    for region, entries in env.listing.items():
        old = prev.get(region, {})
        for idx, (rec_epoch, tag) in entries.items():
            if old.get(idx) == (rec_epoch, tag):
                continue
            found = next((r for r in pages.get((rec_epoch, region, idx), ()) if r.tag == tag), None)
            loc = (found.segment, found.offset, found.length) if found else _indexed(index, seg_dir, region, idx,
                                                                                     rec_epoch, tag)
            if loc is None:
                return None
            rows.append(PageRef(region, idx, rec_epoch, *loc))
    for region, old in prev.items():
        gone = old.keys() - env.listing.get(region, {}).keys()
        rows += [PageRef(region, idx, env.epoch, None, None, None) for idx in sorted(gone)]   # tombstones
    return rows


def _indexed(index: Index, seg_dir: Path, region: str, idx: int, rec_epoch: int,
             tag: bytes) -> tuple[int, int, int] | None:
    """Where the index holds that record (an older page a rolled-back-to epoch sees again)."""
    for seg, off, length in index.query("SELECT segment, offset, length FROM pages WHERE region = ? AND idx = ? "
                                        "AND rec_epoch = ? AND segment IS NOT NULL", (region, idx, rec_epoch)):
        if not all(isinstance(v, int) for v in (seg, off, length)):
            continue
        try:
            fd = open_segment(segment_path(seg_dir, seg))
            try:
                if os.pread(fd, len(tag), off + length - len(tag)) == tag:
                    return seg, off, length
            finally:
                os.close(fd)
        except (OSError, RecordError):
            continue
    return None


def _ends(index: Index, plan: _Plan) -> dict[int, int]:
    """Each segment's committed end after the plan: the end of the last record it adopts there."""
    ends: dict[int, int] = {}
    recs = [s.manifest for s in plan.staged] + [r for s in plan.staged for r in s.rows if r.segment is not None]
    spans = [(r.segment, r.offset + r.length) for r in recs]    # type: ignore[operator]
    spans += [(r.segment, r.offset + r.length) for r, _ in plan.records]
    spans += [(r.segment, r.offset + r.length) for r in plan.forgets]
    live = index.segments("live")
    for seg, end in spans:
        if end > live.get(seg, 0):
            ends[seg] = max(ends.get(seg, 0), end)
    return ends


def _apply(c: sqlite3.Connection, plan: _Plan) -> None:
    insert_epochs(c, plan.staged)
    for rec, head in plan.records:
        keyeddb.put(c, rec.region, rec.index, head.row,
                    PageRef(rec.region, rec.index, rec.epoch, rec.segment, rec.offset, rec.length, KIND_RECORD))
    for rec in plan.forgets:
        keyeddb.forget(c, rec.region, rec.index,
                       keyeddb.forget_ref(rec.region, rec.index, rec.epoch, rec.segment, rec.offset, rec.length))
