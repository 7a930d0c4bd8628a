"""What a scan of the whole log holds, sorted out, and what of it a rebuilt index adopts
(rebuild.py): per epoch the newest envelope of this store whose listed records are all present,
per keyed record not forgotten its newest version that holds its row, and the store's id as its
own records say. What cannot be placed is collected in Found.stray (quarantine.py copies it).

Threading: pure reads of the segment files; the caller holds the Store's locks (or it is not open).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import envelope, keyedrecord
from .envelope import Envelope, Listing
from .records import KIND_EPOCH, KIND_FORGET, KIND_MANIFEST, KIND_PAGE, KIND_RECORD, RecordError, Sealer
from .scan import Scanned, SegmentScan, payload


@dataclass
class Found:
    """What a scan of the whole log holds, sorted out."""
    scans: list[SegmentScan]
    pages: dict[tuple[int, str, int], list[Scanned]] = field(default_factory=dict)
    envelopes: dict[int, list[tuple[Scanned, Envelope]]] = field(default_factory=dict)
    records: dict[tuple[str, int], list[Scanned]] = field(default_factory=dict)   # by (collection, id)
    forgets: dict[tuple[str, int], Scanned] = field(default_factory=dict)
    stray: list[tuple[Scanned, str]] = field(default_factory=list)   # valid records it cannot place


def sort_out(seg_dir: Path, sealer: Sealer, scans: list[SegmentScan]) -> Found:
    """The scanned records by kind (envelopes decoded and checked against their record's epoch)."""
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


def store_id_of(seg_dir: Path, sealer: Sealer, found: Found, hint: str | None) -> str | None:
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


def adoptable(found: Found, store_id: str, report: list[str]) -> list[tuple[Scanned, Envelope]]:
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
                      f"{id_list(missing)}")
    return out


def _complete(found: Found, listing: Listing) -> bool:
    return all(locate(found, region, idx, rec, tag) is not None
               for region, pages in listing.items() for idx, (rec, tag) in pages.items())


def locate(found: Found, region: str, idx: int, rec: int, tag: bytes) -> Scanned | None:
    for cand in found.pages.get((rec, region, idx), ()):
        if cand.tag == tag:
            return cand
    return None


def record_rows(seg_dir: Path, sealer: Sealer, found: Found, store_id: str,
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


def id_list(ids: list[int]) -> str:
    return ", ".join(map(str, ids if len(ids) <= 8 else ids[:4] + ["..."] + ids[-3:]))
