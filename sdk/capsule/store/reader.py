"""Reading an epoch back: its records, grouped by segment and read in offset order, each one
verified (tag, and header fields equal to the index row) before its bytes are returned.

Pure functions over a SegmentReader; the caller holds the Store's state lock.
"""
from __future__ import annotations

from typing import Iterator

from .errors import PageCorrupt
from .info import PageRef
from .records import (MAX_NAME_BYTES, MAX_RECORD_BYTES, RECORD_HEADER, SEGMENT_HEADER, TAG_BYTES, Buffer,
                      RecordError, Sealer, decode_record)
from .segments import SegmentReader

_RUN_BYTES = 8 << 20  # one pread covers contiguous records up to this size
_MIN_RECORD = RECORD_HEADER.size + 8
# a manifest is host metadata (small JSON) plus the store's page listing: far below this
MAX_MANIFEST_BYTES = 64 << 20


def check_ref(ref: PageRef) -> None:
    """Bounds-check an index row (it comes from disk too) before anything is allocated for it."""
    if ref.segment is None or ref.offset is None or ref.length is None:
        raise RecordError("index row has no location")
    if not _MIN_RECORD <= ref.length <= MAX_RECORD_BYTES or ref.offset < SEGMENT_HEADER.size:
        raise RecordError(f"index row claims an impossible record ({ref.length} bytes at {ref.offset})")


def check_record(buf: Buffer, ref: PageRef, sealer: Sealer) -> memoryview:
    """Verify one record's bytes against its tag and its index row; returns the payload view."""
    head, region, payload = decode_record(buf, sealer)
    kind = ref.record_kind  # a fact record can never stand in for a page, nor a page for a fact
    if head.kind != kind:
        raise RecordError(f"record kind {head.kind} where the index expects {kind}")
    if (head.epoch, region, head.index) != (ref.rec_epoch, ref.region or "", ref.index or 0):
        raise RecordError(f"record says epoch {head.epoch} page {region!r}[{head.index}], index expects "
                          f"epoch {ref.rec_epoch} page {ref.region!r}[{ref.index}]")
    return payload


def corrupt(ref: PageRef, reason: str, loading: int) -> PageCorrupt:
    return PageCorrupt(ref.rec_epoch, ref.region, ref.index, ref.segment if ref.segment is not None else -1,
                       ref.offset if ref.offset is not None else -1, reason, loading=loading)


def read_manifest(segs: SegmentReader, sealer: Sealer, manifest: PageRef, loading: int) -> bytes:
    """The manifest record's payload, verified (PageCorrupt if not)."""
    (_, payload), = _read_all(segs, sealer, [_checked(manifest, loading, MAX_MANIFEST_BYTES)], loading)
    return payload  # type: ignore[return-value]


def read_pages(segs: SegmentReader, sealer: Sealer, refs: list[PageRef], loading: int,
               max_page_bytes: int | None = None) -> dict[str, dict[int, bytes]]:
    """{region: {index: payload}}; PageCorrupt on the first record that fails. A record whose
    row claims a payload above max_page_bytes is refused before it is read."""
    checked = [_checked(ref, loading, max_page_bytes) for ref in refs]
    pages: dict[str, dict[int, bytes]] = {}
    for ref, payload in _read_all(segs, sealer, sorted(checked, key=_order), loading):
        pages.setdefault(ref.region, {})[ref.index] = payload  # type: ignore[index]
    return pages


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
              loading: int) -> Iterator[tuple[PageRef, bytes]]:
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
            # pages stay zero-copy views of the map; the (small) manifest becomes bytes
            yield ref, bytes(payload) if ref.region is None else payload
