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
are copied into quarantine/ so compaction can never destroy them.

Threading: the caller holds the Store's writer and state locks (or the store is not open yet).
"""
from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import envelope, keyeddb, keyedrecord, quarantine
from .envelope import Envelope, Listing
from .errors import IndexCorrupt
from .index import Index
from .info import EpochInfo, Head, PageRef, StagedEpoch
from .records import (STORE_FORMAT_VERSION, KIND_EPOCH, KIND_FORGET, KIND_MANIFEST, KIND_PAGE, KIND_RECORD,
                      RecordError, Sealer)
from .scan import Scanned, SegmentScan, payload, scan_segment, open_segment
from .segments import Position, list_segment_files, segment_path



TMP_INDEX = "index.sqlite.rebuild"


@dataclass
class Found:
    """What a scan of the whole log holds, sorted out."""
    scans: list[SegmentScan]
    pages: dict[tuple[int, str, int], list[Scanned]] = field(default_factory=dict)
    envelopes: dict[int, list[tuple[Scanned, Envelope]]] = field(default_factory=dict)
    records: dict[tuple[str, int], list[Scanned]] = field(default_factory=dict)   # by (collection, id)
    forgets: dict[tuple[str, int], Scanned] = field(default_factory=dict)
    stray: list[tuple[Scanned, str]] = field(default_factory=list)   # valid records it cannot place


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
    found = _sort_out(seg_dir, sealer, scans)
    store_id = _store_id(seg_dir, sealer, found, store_id) or uuid.uuid4().hex
    report = [f"index rebuilt from the segment log ({why})"]
    epochs = _adoptable(found, store_id, report)
    keyed = _record_rows(seg_dir, sealer, found, store_id, report)
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
    held_ids = f" ({_ids([e.epoch for _, e in epochs])})" if epochs else ""
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


def _sort_out(seg_dir: Path, sealer: Sealer, scans: list[SegmentScan]) -> Found:
    found = Found(scans)
    for scan in scans:
        for rec in scan.records:
            if rec.kind == KIND_PAGE:
                found.pages.setdefault((rec.epoch, rec.region, rec.index), []).append(rec)
            elif rec.kind == KIND_EPOCH:
                try:
                    env = envelope.decode(payload(seg_dir, rec, sealer), sealer.tag_bytes)
                except RecordError as exc:
                    found.stray.append((rec, f"unreadable envelope: {exc}"))
                    continue
                if env.epoch != rec.epoch:
                    found.stray.append((rec, "envelope of another epoch than its record"))
                    continue
                found.envelopes.setdefault(rec.epoch, []).append((rec, env))
            elif rec.kind == KIND_RECORD:
                found.records.setdefault((rec.region, rec.index), []).append(rec)
            elif rec.kind == KIND_FORGET:
                found.forgets[(rec.region, rec.index)] = rec
            elif rec.kind == KIND_MANIFEST:
                found.stray.append((rec, "bare manifest of an older SDK (no record listing)"))
    return found


def _store_id(seg_dir: Path, sealer: Sealer, found: Found, hint: str | None) -> str | None:
    """The store's id as its own records say: the old index's (the hint) when some epoch or keyed
    record names it (records transplanted from another store never outvote it), else the one most
    records name (the hint may be damage)."""
    ids = Counter(env.store_id for cands in found.envelopes.values() for _, env in cands)
    if not ids:
        for recs in found.records.values():
            try:
                head, _ = keyedrecord.decode(payload(seg_dir, max(recs, key=lambda r: r.epoch), sealer))
            except RecordError:
                continue
            if head is not None:
                ids[head.store_id] += 1
    if hint is not None and hint in ids:
        return hint
    return ids.most_common(1)[0][0] if ids else hint


def _adoptable(found: Found, store_id: str, report: list[str]) -> list[tuple[Scanned, Envelope]]:
    """Per epoch, the newest envelope of this store whose every listed record is present."""
    out, missing = [], []
    for epoch in sorted(found.envelopes):
        best = None
        for rec, env in found.envelopes[epoch]:
            if env.store_id != store_id:
                found.stray.append((rec, f"envelope of another store ({env.store_id})"))
            elif _complete(found, env.listing):
                best = (rec, env)       # later in the log wins: an epoch number reused after a cut
        if best is None:
            missing.append(epoch)
        else:
            out.append(best)
    # the newest epoch names the epochs retention had kept: older ones, dropped, stay dropped
    kept = next((env.retained for _, env in reversed(out) if env.retained is not None), None)
    if kept is not None:
        out = [(rec, env) for rec, env in out if envelope.holds(kept, env.epoch)]
        missing = [e for e in missing if envelope.holds(kept, e)]
    if missing:
        report.append(f"epochs left out, records missing or damaged (or dropped by retention): "
                      f"{_ids(missing)}")
    return out


def _complete(found: Found, listing: Listing) -> bool:
    return all(_locate(found, region, idx, rec, tag) is not None
               for region, pages in listing.items() for idx, (rec, tag) in pages.items())


def _locate(found: Found, region: str, idx: int, rec: int, tag: bytes) -> Scanned | None:
    for cand in found.pages.get((rec, region, idx), ()):
        if cand.tag == tag:
            return cand
    return None


def _record_rows(seg_dir: Path, sealer: Sealer, found: Found, store_id: str,
                 report: list[str]) -> list[tuple[Scanned, keyedrecord.Head]]:
    """Per (collection, id) not forgotten, its newest record that holds its row."""
    out, legacy = [], []
    for key in sorted(found.records):
        if key in found.forgets:
            continue
        for rec in sorted(found.records[key], key=lambda r: (r.epoch, r.segment, r.offset), reverse=True):
            try:
                head, _ = keyedrecord.decode(payload(seg_dir, rec, sealer))
            except RecordError as exc:
                found.stray.append((rec, f"unreadable keyed record: {exc}"))
                continue
            if head is None:
                found.stray.append((rec, "keyed record of an older SDK (its row is not in the log)"))
                legacy.append(f"{key[0]} {key[1]}")
            elif head.store_id != store_id:
                found.stray.append((rec, f"keyed record of another store ({head.store_id})"))
                continue
            else:
                out.append((rec, head))
            break
    if legacy:
        report.append(f"records {', '.join(legacy[:8])} were written by an older SDK and cannot be rebuilt: "
                      f"their records are copied into quarantine/")
    return out


def _refuse_if_unsafe(found: Found, scans: list[SegmentScan], epochs: list, keyed: list, sealer: Sealer,
                      held_before: Held | None) -> None:
    """A rebuild must never stand in for an index it cannot replace (nothing is changed then)."""
    misnamed = [s.segment for s in scans if s.header_error and "expected" in s.header_error]
    if misnamed:
        raise IndexCorrupt(f"segment files {_ids(misnamed)} hold other segments than their names say (renamed "
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
        raise IndexCorrupt(f"the log's newest epochs ({_ids(sorted(set(bare)))}) were written by an older SDK "
                           f"without record listings, so the index cannot be rebuilt from it. Nothing was "
                           f"changed; restore index.sqlite from a backup, or keep a copy of the folder")


def _write(index: Index, sealer: Sealer, store_id: str, created: str | None,
           epochs: list[tuple[Scanned, Envelope]], keyed: list, found: Found) -> None:
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


def _rows(found: Found, env: Envelope, prev: Listing) -> list[PageRef]:
    """The index rows that turn the previous adopted epoch's view into env's."""
    rows = []
    for region, pages in env.listing.items():
        old = prev.get(region, {})
        for idx, (rec_epoch, tag) in pages.items():
            if old.get(idx) != (rec_epoch, tag):
                rec = _locate(found, region, idx, rec_epoch, tag)
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


def _records(c, keyed: list, found: Found) -> None:
    for rec, head in keyed:
        keyeddb.put(c, rec.region, rec.index, head.row, PageRef(rec.region, rec.index, rec.epoch, rec.segment,
                                                                  rec.offset, rec.length, KIND_RECORD))
    for (coll, rid), rec in found.forgets.items():
        keyeddb.forget(c, coll, rid, keyeddb.forget_ref(coll, rid, rec.epoch, rec.segment, rec.offset, rec.length))
    for coll, rid in found.records:          # ids never reused, even of records left out
        keyeddb.raise_top(c, coll, rid)


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids if len(ids) <= 8 else ids[:4] + ["..."] + ids[-3:]))

