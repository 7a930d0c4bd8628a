"""Reading an epoch back: its records, grouped by segment and read in offset order, each one
verified (tag, and header fields equal to the index row) before its bytes are returned.

The index is only an accelerator: an epoch's envelope (envelope.py) lists every record its view
uses, and the rows the index gives must name exactly those records (same pages, same writing
epoch, same tag), else IndexStale says the index must be rebuilt from the log. Epochs written
before envelopes (KIND_MANIFEST) have no listing and are read as the index says.

Pure functions over a SegmentReader; the caller holds the Store's state lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from . import envelope
from .envelope import Envelope, Listing
from .errors import IndexStale, PageCorrupt
from .info import PageRef
from .records import (KIND_EPOCH, KIND_MANIFEST, MAX_MANIFEST_BYTES, MAX_NAME_BYTES, MAX_RECORD_BYTES,
                      RECORD_HEADER, SEGMENT_HEADER, TAG_BYTES, Buffer, RecordError, Sealer, decode_record)
from .segments import SegmentReader

_RUN_BYTES = 8 << 20  # one pread covers contiguous records up to this size
_MIN_RECORD = RECORD_HEADER.size + 8


@dataclass(frozen=True)
class Manifest:
    """An epoch's manifest as read: the caller's bytes, and the envelope (None: an older bare one)."""
    app: bytes
    envelope: Envelope | None


def check_ref(ref: PageRef) -> None:
    """Bounds-check an index row (it comes from disk too) before anything is allocated for it."""
    if ref.segment is None or ref.offset is None or ref.length is None:
        raise RecordError("index row has no location")
    if not _MIN_RECORD <= ref.length <= MAX_RECORD_BYTES or ref.offset < SEGMENT_HEADER.size:
        raise RecordError(f"index row claims an impossible record ({ref.length} bytes at {ref.offset})")


def check_record(buf: Buffer, ref: PageRef, sealer: Sealer) -> memoryview:
    """Verify one record's bytes against its tag and its index row; returns the payload view."""
    return _check(buf, ref, sealer)[0]


def _check(buf: Buffer, ref: PageRef, sealer: Sealer) -> tuple[memoryview, int]:
    head, region, payload = decode_record(buf, sealer)
    kind = ref.record_kind  # a keyed record can never stand in for a page, nor a page for a keyed one
    if head.kind != kind and not (kind == KIND_MANIFEST and head.kind == KIND_EPOCH):
        raise RecordError(f"record kind {head.kind} where the index expects {kind}")
    if (head.epoch, region, head.index) != (ref.rec_epoch, ref.region or "", ref.index or 0):
        raise RecordError(f"record says epoch {head.epoch} page {region!r}[{head.index}], index expects "
                          f"epoch {ref.rec_epoch} page {ref.region!r}[{ref.index}]")
    return payload, head.kind


def corrupt(ref: PageRef, reason: str, loading: int) -> PageCorrupt:
    exc = PageCorrupt(ref.rec_epoch, ref.region, ref.index, ref.segment if ref.segment is not None else -1,
                      ref.offset if ref.offset is not None else -1, reason, loading=loading)
    exc.length = ref.length   # what the row claims (loading.misplaced compares it with the record)
    return exc


def read_manifest(segs: SegmentReader, sealer: Sealer, manifest: PageRef, loading: int,
                  store_id: str | None = None, legacy_until: int | None = None) -> Manifest:
    """The manifest record, verified (PageCorrupt if not). An envelope must name this store
    (store_id) and this epoch. A bare manifest is refused for epochs after legacy_until (a store
    that writes envelopes never writes bare ones)."""
    ref = _checked(manifest, loading, MAX_MANIFEST_BYTES)
    try:
        buf = memoryview(segs.read(ref.segment, ref.offset, ref.length))  # type: ignore[arg-type]
        payload, kind = _check(buf, ref, sealer)
        if kind == KIND_MANIFEST:
            if legacy_until is not None and loading > legacy_until:
                raise RecordError("bare manifest where this store writes epoch envelopes")
            return Manifest(bytes(payload), None)
        env = envelope.decode(payload, sealer.tag_bytes)
        if env.epoch != loading:
            raise RecordError(f"envelope is epoch {env.epoch}'s")
        if store_id is not None and env.store_id != store_id:
            raise RecordError(f"envelope belongs to store {env.store_id}, not this one ({store_id})")
    except RecordError as exc:
        raise corrupt(ref, str(exc), loading) from None
    return Manifest(env.app, env)


def read_pages(segs: SegmentReader, sealer: Sealer, refs: list[PageRef], loading: int,
               max_page_bytes: int | None = None, listing: Listing | None = None,
               whole: bool = True) -> dict[str, dict[int, bytes]]:
    """{region: {index: payload}}; PageCorrupt on the first record that fails. A record whose
    row claims a payload above max_page_bytes is refused before it is read. With a listing, the
    rows must name exactly the listed records (IndexStale otherwise); whole=False: refs are a part
    of the view, each of them listed."""
    checked = [_checked(ref, loading, max_page_bytes) for ref in refs]
    if listing is not None:
        check_view(checked, listing, loading, whole)
    pages: dict[str, dict[int, bytes]] = {}
    for ref, payload, tag in _read_all(segs, sealer, sorted(checked, key=_order), loading):
        if listing is not None and listing[ref.region][ref.index][1] != tag:  # type: ignore[index]
            raise IndexStale(f"epoch {loading}: the index points page {ref.region}[{ref.index}] at a record "
                             f"its envelope does not list (same name, other bytes)")
        pages.setdefault(ref.region, {})[ref.index] = payload  # type: ignore[index]
    return pages


def read_tags(segs: SegmentReader, sealer: Sealer, refs: list[PageRef], loading: int
              ) -> dict[str, dict[int, bytes]]:
    """{region: {index: tag}} of the records refs point at, each verified (PageCorrupt if not)."""
    checked = [_checked(ref, loading, None) for ref in refs]
    tags: dict[str, dict[int, bytes]] = {}
    for ref, _, tag in _read_all(segs, sealer, sorted(checked, key=_order), loading):
        tags.setdefault(ref.region, {})[ref.index] = tag  # type: ignore[index]
    return tags


def check_view(refs: list[PageRef], listing: Listing, loading: int, whole: bool = True) -> None:
    """The index's view of an epoch must be exactly its envelope's listing (IndexStale); whole=False:
    refs are some of the view's pages, each the record the listing names."""
    listed = sum(len(p) for p in listing.values())
    for ref in refs:
        entry = listing.get(ref.region, {}).get(ref.index)  # type: ignore[arg-type]
        if entry is None or entry[0] != ref.rec_epoch:
            raise IndexStale(f"epoch {loading}: the index's page {ref.region}[{ref.index}] (written by epoch "
                             f"{ref.rec_epoch}) is not the one its envelope lists ({entry and entry[0]})")
    if whole and listed != len(refs):
        raise IndexStale(f"epoch {loading}: the index holds {len(refs)} pages, its envelope lists {listed}")


def _checked(ref: PageRef, loading: int, max_payload: int | None) -> PageRef:
    try:
        check_ref(ref)
        if max_payload is not None:
            most = RECORD_HEADER.size + MAX_NAME_BYTES + max_payload + max(TAG_BYTES.values())
            if ref.length > most:  # type: ignore[operator]
                raise RecordError(f"index row claims a {ref.length}-byte record; this epoch's pages "
                                  f"are at most {max_payload} bytes")
    except RecordError as exc:
        raise corrupt(ref, str(exc), loading) from None
    return ref


def _order(ref: PageRef) -> tuple[int, int]:
    return ref.segment, ref.offset  # type: ignore[return-value]


def _runs(refs: list[PageRef]) -> Iterator[list[PageRef]]:
    run: list[PageRef] = []
    for ref in refs:
        if run and (ref.segment != run[0].segment or ref.offset != run[-1].offset + run[-1].length
                    or ref.offset + ref.length - run[0].offset > _RUN_BYTES):
            yield run
            run = []
        run.append(ref)
    if run:
        yield run


def _read_all(segs: SegmentReader, sealer: Sealer, refs: list[PageRef],
              loading: int) -> Iterator[tuple[PageRef, memoryview, bytes]]:
    """(ref, payload view, tag) per record, each verified; pages stay zero-copy views of the map."""
    tag_len = sealer.tag_bytes
    for run in _runs(refs):
        start = run[0].offset
        try:
            blob = segs.view(run[0].segment, start, run[-1].offset + run[-1].length - start)
        except RecordError:
            blob = None  # find exactly which record is unreadable, one by one
        for ref in run:
            try:
                if blob is None:
                    buf = memoryview(segs.read(ref.segment, ref.offset, ref.length))
                else:
                    buf = blob[ref.offset - start:ref.offset - start + ref.length]
                payload = check_record(buf, ref, sealer)
            except RecordError as exc:
                raise corrupt(ref, str(exc), loading) from None
            yield ref, payload, bytes(buf[len(buf) - tag_len:])
