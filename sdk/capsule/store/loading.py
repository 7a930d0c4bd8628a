"""Loading epochs: one by id, or the newest that is fully valid, and telling whose fault a failure is.

A record that fails to load is either damage in the log (a flipped bit: the epoch is skipped
and reported, older epochs may still load) or a wrong index (a row pointing outside the
committed log, at another intact record, or rows that disagree with the epoch's envelope:
IndexStale, and the Store rebuilds the index from the log once and loads again). Many epochs
failing in a row is also taken as a wrong index: a rebuild is cheaper than reading thousands
of bogus rows, and it leaves exactly the epochs whose records are all intact.

Pure functions over an Index and a SegmentReader; the caller holds the Store's state lock.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CapsuleCorrupt, CapsuleError, CapsuleMismatch
from .errors import IndexCorrupt, IndexStale, PageCorrupt
from .index import Index
from .info import PageRef
from .reader import read_manifest, read_pages
from .records import RECORD_HEADER, RECORD_MAGIC, SEGMENT_HEADER, RecordError, Sealer, decode_record, parse_header
from .scan import open_segment
from .segments import SegmentReader, segment_path

Pages = dict[str, dict[int, bytes]]
Accept = Callable[[int, bytes], None]
SUSPECT_AFTER = 8   # consecutive damaged epochs before the index is suspected instead of the log
# what an envelope adds to the caller's manifest: record header, head JSON, the listing (a
# generous bound: 16 MiB of head + listing, far above what any session writes)
MAX_ENVELOPE_OVERHEAD = 16 << 20
_VERIFY_BYTES = 16 << 20   # misplaced() checks records up to this size whole


class _KnownBad(Exception):
    """The epoch's view uses a record an epoch tried before found corrupt (not read again)."""


@dataclass(frozen=True)
class Ident:
    """Which store this is: what an epoch's envelope must say to belong here, and where its log is."""
    store_id: str
    legacy_until: int   # bare manifests are accepted only up to this epoch
    seg_dir: Path


def load(index: Index, segs: SegmentReader, sealer: Sealer, ident: Ident, manifest: PageRef, epoch: int,
         max_page_bytes: int | None, accept: Accept | None = None, bad: set | None = None,
         max_manifest_bytes: int | None = None, only: frozenset[tuple[str, int]] | None = None
         ) -> tuple[bytes, Pages]:
    """One epoch: its manifest (envelope checked against this store), accept, then its view (only:
    just those (region, index) of it; one the view lacks is absent from the result)."""
    _bound_manifest(manifest, epoch, max_manifest_bytes)
    man = read_manifest(segs, sealer, manifest, epoch, ident.store_id, ident.legacy_until)
    if accept is not None:
        accept(epoch, man.app)
    view = index.view(epoch)
    if only is not None:
        view = [ref for ref in view if (ref.region, ref.index) in only]
    if bad and any(ref.location in bad for ref in view):
        raise _KnownBad()
    listing = man.envelope.listing if man.envelope is not None else None
    return man.app, read_pages(segs, sealer, view, epoch, max_page_bytes, listing, whole=only is None)


def manifest(segs: SegmentReader, sealer: Sealer, ident: Ident, ref: PageRef, epoch: int,
             max_bytes: int | None) -> bytes:
    """The caller's manifest bytes of one epoch (PageCorrupt if its record is bad or too big)."""
    _bound_manifest(ref, epoch, max_bytes)
    return read_manifest(segs, sealer, ref, epoch, ident.store_id, ident.legacy_until).app


def _bound_manifest(ref: PageRef, epoch: int, max_bytes: int | None) -> None:
    if max_bytes is not None and ref.length is not None and ref.length > max_bytes + MAX_ENVELOPE_OVERHEAD:
        raise PageCorrupt(epoch, None, None, ref.segment or -1, ref.offset or -1,
                          f"manifest record of {ref.length} bytes; at most {max_bytes} are read", loading=epoch)


def newest_valid(index: Index, segs: SegmentReader, sealer: Sealer, ident: Ident, accept: Accept | None,
                 max_page_bytes: int | None, suspect: bool, max_manifest_bytes: int | None = None
                 ) -> tuple[int, bytes, Pages, list[str]] | None:
    """See Store.load_newest_valid. suspect: a failure the index may be at fault for raises
    IndexStale (the caller rebuilds and calls again with suspect=False)."""
    ids = index.epoch_ids()
    bad: set[tuple[int | None, int | None]] = set()
    skipped: list[str] = []
    mismatch: CapsuleMismatch | None = None
    in_a_row = 0
    for epoch in reversed(ids):
        manifest = index.manifest_ref(epoch)
        if manifest is None:
            continue  # dropped concurrently
        if manifest.location in bad:
            skipped.append(f"epoch {epoch}: uses a record already found corrupt")
            continue
        try:
            man, pages = load(index, segs, sealer, ident, manifest, epoch, max_page_bytes, accept, bad,
                              max_manifest_bytes)
        except _KnownBad:
            in_a_row += 1
            if suspect and in_a_row >= SUSPECT_AFTER:
                raise IndexStale(f"epoch {epoch} and the {in_a_row - 1} epochs after it cannot be read; the "
                                 f"index, not the log, looks wrong") from None
            skipped.append(f"epoch {epoch}: uses a record already found corrupt")
            continue
        except PageCorrupt as exc:
            in_a_row += 1
            if suspect and (in_a_row >= SUSPECT_AFTER or misplaced(index, ident.seg_dir, sealer, exc)):
                raise IndexStale(f"{exc.summary}; the index, not the log, looks wrong") from exc
            bad.add((exc.segment, exc.offset))
            skipped.append(exc.summary)
            continue
        except CapsuleMismatch as exc:
            mismatch = mismatch or exc
            skipped.append(f"epoch {epoch}: {exc}")
            continue
        except IndexCorrupt:
            raise                      # the index, not this epoch: the caller rebuilds it
        except CapsuleError as exc:
            skipped.append(f"epoch {epoch}: {exc}")
            continue
        return epoch, man, pages, skipped
    if not ids:
        return None
    if mismatch is not None:
        others = [s for s in skipped if not s.endswith(str(mismatch))]
        raise CapsuleMismatch(f"{mismatch}" + (f" (other epochs skipped: {' | '.join(others[:8])})"
                                               if others else "")) from mismatch
    raise CapsuleCorrupt(f"store {ident.seg_dir.parent} holds {len(ids)} epochs ({ids[0]}..{ids[-1]}) and none is "
                         f"fully valid; skipped: {' | '.join(skipped[:8])}. Keep a copy of the folder "
                         f"and run `capsule verify`")


def misplaced(index: Index, seg_dir: Path, sealer: Sealer, exc: PageCorrupt) -> bool:
    """Whether the index, not the log, is wrong about the record exc names: it points outside the
    committed part of a live segment, past the end of an intact file, where no record starts, or
    at a record of another identity or length (its header says). (A segment shorter than its committed end lost bytes:
    the log is damaged, not the index.)"""
    end = index.segments("live").get(exc.segment)
    if end is None or not SEGMENT_HEADER.size <= exc.offset < end:
        return True
    if not os.path.lexists(segment_path(seg_dir, exc.segment)):
        return True    # a live segment the index lists is gone: deleted by a compaction the index lost?
    try:
        fd = open_segment(segment_path(seg_dir, exc.segment))
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, RECORD_HEADER.size, exc.offset)
            if size < end:
                return False                      # the file lost committed bytes
            if not raw.startswith(RECORD_MAGIC):
                return True                       # no record starts where the row says
            head = parse_header(raw)
            if exc.length is not None and exc.length != head.total:
                return True                       # a record starts there, of another length than the row's
            if exc.offset + head.total > end:
                return False
            if head.total <= _VERIFY_BYTES:       # damaged bytes (a checksum that fails) are the log's fault
                head, region, _ = decode_record(os.pread(fd, head.total, exc.offset), sealer)
            else:   # header and name only: a huge record (refused for its size) is never read whole
                region = os.pread(fd, head.name_len, exc.offset + RECORD_HEADER.size).decode("utf-8")
        finally:
            os.close(fd)
    except (OSError, RecordError, UnicodeDecodeError):
        return False    # damaged bytes at a record the index may well be right about
    # the very record the row names (damaged, or refused for itself, too big for the caller say):
    # the row is right
    return (head.epoch, region, head.index) != (exc.epoch, exc.region or "", exc.index or 0)
