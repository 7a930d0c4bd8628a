"""Rebuilding index.sqlite from the segment log alone (the log is the truth; the index a cache).

Every record says what it is; every epoch envelope lists the records its view uses; every keyed
record holds its row; every forget is a record. So a scan of the segments gives back:
- each epoch whose envelope names this store and whose listed records are all present and
  verify (an epoch missing a record is left out and reported: damaged, or dropped by retention
  and compacted);
- each keyed record's newest version (unless a forget record follows it), with its row;
- the segments' committed ends and the log's head.
The new index is built in a temporary file next to the old one, synced, and only then swapped in;
the old index files are moved into quarantine/, never deleted. No segment byte is changed. Records
the rebuild cannot place (an older SDK's bare manifests or headless records, another store's records)
are copied into quarantine/ so compaction can never destroy them. Sorting the scan out and choosing
what is adopted: salvage.py; this module refuses an unsafe rebuild and writes the new index.

Threading: the caller holds the Store's writer and state locks (or the store is not open yet).
"""
from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import keyeddb, quarantine, salvage
from .envelope import Envelope, Listing
from .errors import IndexCorrupt
from .index import Index
from .info import EpochInfo, Head, PageRef, StagedEpoch
from .records import STORE_FORMAT_VERSION, KIND_MANIFEST, KIND_PAGE, KIND_RECORD, Sealer
from .salvage import id_list
from .scan import Scanned, SegmentScan, scan_segment, open_segment
from .segments import Position, list_segment_files, segment_path

TMP_INDEX = "index.sqlite.rebuild"


@dataclass(frozen=True)
class Held:
    """What the index being replaced listed (when it could still say)."""
    epochs: int
    records: int


def rebuild_index(path: Path, sealer: Sealer, *, store_id: str | None, created: str | None, why: str,
                  progress: Callable[[int, int], None] | None = None, held: Held | None = None) -> list[str]:
    """Replace path/index.sqlite by one built from path/segments; returns the report lines.
    store_id / created: what the old index said (hints: the log's own envelopes decide). held:
    what the old index listed. IndexCorrupt (nothing changed) when the log cannot stand in for
    the index: nothing verifies, segment files are misnamed, or none of what it held is found."""
    seg_dir = path / "segments"
    files = sorted(list_segment_files(seg_dir))
    scans = []
    for n, seg in enumerate(files):
        scans.append(scan_segment(seg_dir, seg, sealer))
        if progress is not None:
            progress(n + 1, len(files))
    found = salvage.sort_out(seg_dir, sealer, scans)
    store_id = salvage.store_id_of(seg_dir, sealer, found, store_id) or uuid.uuid4().hex
    report = [f"index rebuilt from the segment log ({why})"]
    epochs = salvage.adoptable(found, store_id, report)
    keyed = salvage.record_rows(seg_dir, sealer, found, store_id, report)
    _refuse_if_unsafe(found, scans, epochs, keyed, sealer, held)
    if found.stray:
        report.append(quarantine.copy_records(path, [(r, why) for r, why in found.stray]))
    _sync_segments(seg_dir, scans)   # what the new index adopts must be durable before it commits
    tmp = path / TMP_INDEX
    quarantine.remove_leftover(tmp)
    index = Index.open(tmp, create=True, segments_exist=False)
    try:
        _write(index, sealer, store_id, created, epochs, keyed, found)
    finally:
        index.close()
    quarantine.swap_index(path, tmp)
    held_ids = f" ({id_list([e.epoch for _, e in epochs])})" if epochs else ""
    report.append(f"{len(epochs)} epochs{held_ids} and {len(keyed)} keyed records recovered")
    if held is not None and (len(epochs) < held.epochs or len(keyed) < held.records):
        report.append(f"the replaced index listed {held.epochs} epochs and {held.records} keyed records: the "
                      f"rest are missing from the log or damaged there")
    return report


def discard_unfinished(path: Path) -> None:
    """Remove the temporary index of a rebuild that did not finish (it never was the index)."""
    quarantine.remove_leftover(path / TMP_INDEX)


def _sync_segments(seg_dir: Path, scans: list[SegmentScan]) -> None:
    """fsync every readable segment: a crashed writer may have left adopted records unsynced."""
    for scan in scans:
        if scan.header_error is None and scan.records:
            fd = open_segment(segment_path(seg_dir, scan.segment))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _refuse_if_unsafe(found: salvage.Found, scans: list[SegmentScan], epochs: list, keyed: list, sealer: Sealer,
                      held_before: Held | None) -> None:
    """A rebuild must never stand in for an index it cannot replace (nothing is changed then)."""
    misnamed = [s.segment for s in scans if s.header_error and "expected" in s.header_error]
    if misnamed:
        raise IndexCorrupt(f"segment files {id_list(misnamed)} hold other segments than their names say (renamed "
                           f"or copied files?): give each file back the name its header carries and open again. "
                           f"Nothing was changed")
    # an index without epochs in place of one with epochs would restore nothing, silently; records
    # the log lacks are reported instead (the old rows point at damaged records anyway)
    if held_before is not None and ((held_before.epochs and not epochs) or (held_before.records and not keyed
                                                                             and not epochs)):
        what = 'epochs' if epochs == [] and held_before.epochs else 'keyed records'
        raise IndexCorrupt(f"the index lists {held_before.epochs} epochs and {held_before.records} keyed records, "
                           f"and the segment log holds none of its {what}"
                           f": segment files are missing or damaged. Nothing was changed; keep a copy of the "
                           f"folder and run `capsule verify`")
    held = sum(max(0, s.size - s.start) for s in scans)
    valid = sum(len(s.records) for s in scans)
    if held and not valid:
        raise IndexCorrupt(f"no record of the {len(scans)} segment files verifies"
                           + (" with this sign_key (wrong key?)" if sealer.signed else "")
                           + "; the index cannot be rebuilt. Nothing was changed; keep a copy of the folder")
    bare = [r.epoch for r, why in found.stray if r.kind == KIND_MANIFEST]
    newest = max((e.epoch for _, e in epochs), default=0)
    if bare and max(bare) > newest:
        raise IndexCorrupt(f"the log's newest epochs ({id_list(sorted(set(bare)))}) were written by an older SDK "
                           f"without record listings, so the index cannot be rebuilt from it. Nothing was "
                           f"changed; restore index.sqlite from a backup, or keep a copy of the folder")


def _write(index: Index, sealer: Sealer, store_id: str, created: str | None,
           epochs: list[tuple[Scanned, Envelope]], keyed: list, found: salvage.Found) -> None:
    staged, prev = [], {}
    names = Counter(env.name for _, env in epochs if env.name is not None)
    for rec, env in epochs:
        rows = _rows(found, env, prev)
        name = env.name if env.name is None or names[env.name] == 1 or env is _last_named(epochs, env.name) \
            else None                             # a name reused after its first epoch was dropped
        info = EpochInfo(env.epoch, name, env.created, env.page_bytes + rec.length, env.n_pages, env.meta, env.base)
        staged.append(StagedEpoch(info, PageRef(None, None, env.epoch, rec.segment, rec.offset, rec.length),
                                  tuple(rows), Position(None, 0)))
        prev = env.listing
    ends = _ends(found.scans, max(found.envelopes, default=0))
    index.init_meta({"store_id": store_id, "format_version": str(STORE_FORMAT_VERSION),
                     "created": created or str(time.time()), "signed": "1" if sealer.signed else "0",
                     "key_check": sealer.key_check(store_id), "legacy_until": "0",
                     "rebuilt": str(time.time())})
    index.commit(staged, ends, _head(found.scans, ends))
    index.write("rebuilding the keyed records", lambda c: _records(c, keyed, found))


def _rows(found: salvage.Found, env: Envelope, prev: Listing) -> list[PageRef]:
    """The index rows that turn the previous adopted epoch's view into env's."""
    rows = []
    for region, pages in env.listing.items():
        old = prev.get(region, {})
        for idx, (rec_epoch, tag) in pages.items():
            if old.get(idx) != (rec_epoch, tag):
                rec = salvage.locate(found, region, idx, rec_epoch, tag)
                rows.append(PageRef(region, idx, rec_epoch, rec.segment, rec.offset, rec.length))  # type: ignore
    for region, old in prev.items():
        gone = old.keys() - env.listing.get(region, {}).keys()
        rows += [PageRef(region, idx, env.epoch, None, None, None) for idx in sorted(gone)]   # tombstones
    return rows


def _last_named(epochs: list[tuple[Scanned, Envelope]], name: str) -> Envelope:
    return [env for _, env in epochs if env.name == name][-1]


def _ends(scans: list[SegmentScan], newest: int) -> dict[int, int]:
    """Committed end per readable segment: the end of its last valid record, except, in the
    highest, a trailing run of pages of epochs after every epoch the log names (an interrupted
    write, which recovery then cuts). Valid records of damaged epochs stay where they are."""
    ok = [s for s in scans if s.header_error is None]
    ends = {s.segment: s.end for s in ok}
    if ok:
        top = ok[-1]
        end = top.end
        for rec in reversed(top.records):
            if rec.kind != KIND_PAGE or rec.epoch <= newest or rec.offset + rec.length != end:
                break
            end = rec.offset
        ends[top.segment] = end
    return ends


def _head(scans: list[SegmentScan], ends: dict[int, int]) -> Head | None:
    if not ends:
        return None
    top = max(ends)
    last = [r for s in scans if s.segment == top for r in s.records if r.offset + r.length == ends[top]]
    return Head(top, last[0].offset, last[0].length, last[0].tag) if last else None


def _records(c, keyed: list, found: salvage.Found) -> None:
    for rec, head in keyed:
        keyeddb.put(c, rec.region, rec.index, head.row, PageRef(rec.region, rec.index, rec.epoch, rec.segment,
                                                                  rec.offset, rec.length, KIND_RECORD))
    for (coll, rid), rec in found.forgets.items():
        keyeddb.forget(c, coll, rid, keyeddb.forget_ref(coll, rid, rec.epoch, rec.segment, rec.offset, rec.length))
    for coll, rid in found.records:          # ids never reused, even of records left out
        keyeddb.raise_top(c, coll, rid)
