"""What a delta epoch starts from: its base's listing (envelope.Listing: per region and index, the
record epoch and tag of the page it sees) and the index-only rows that make its view = the base's
view + its own pages when the base is not the epoch just before it (no bytes rewritten).

Threading: called by the Committer with the state lock held (it reads the index).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import StoreError
from .envelope import Listing
from .errors import PageCorrupt, UnknownEpoch
from .index import Index
from .info import PageRef, StagedEpoch
from .reader import read_manifest, read_tags
from .records import Sealer
from .segments import SegmentReader


def base_listing(seg_dir: Path, sealer: Sealer, index: Index, newest: tuple[int, Listing] | None,
                 epoch: int, base: int | None, where: Path) -> Listing:
    """The listing epoch's view starts from: base's (default: epoch - 1; 0: empty). newest: the
    listing of the newest staged or committed epoch, when known (used unread when it is base's)."""
    of = epoch - 1 if base is None else base
    if of == 0:
        return {}
    if newest is not None and newest[0] == of:
        return newest[1]
    ref = index.manifest_ref(of)
    if ref is None:
        raise UnknownEpoch(f"base epoch {of} is not in store {where}")
    return listing_of(seg_dir, sealer, index, ref, of)


def base_rows(index: Index, staged: list[StagedEpoch], epoch: int, base: int | None,
              written: set[tuple[str, int]], where: Path) -> list[PageRef]:
    """Index-only rows that make epoch's view = base's view + its pages (no bytes rewritten)."""
    if base is not None and (isinstance(base, bool) or not isinstance(base, int) or not 0 <= base < epoch):
        raise ValueError(f"base must be 0 or an epoch before {epoch}, got {base!r}")
    if base is None or base == epoch - 1:
        return []
    if staged:
        raise ValueError("sync() the staged epochs before writing an epoch with an older base")
    if base and index.manifest_ref(base) is None:
        raise UnknownEpoch(f"base epoch {base} is not in store {where} (dropped by retention?)")
    old = {(r.region, r.index): r for r in index.view(base)} if base else {}
    rows = []
    for key in sorted(index.changed_after(base) - written):
        ref = old.get(key)
        rows.append(PageRef(key[0], key[1], ref.rec_epoch, ref.segment, ref.offset, ref.length) if ref
                    else PageRef(key[0], key[1], epoch, None, None, None))  # tombstone
    return rows


def listing_of(seg_dir: Path, sealer: Sealer, index: Index, manifest: PageRef, epoch: int) -> Listing:
    """A committed epoch's listing: its envelope's; for an older bare manifest, built from the
    index rows and the tags of the records they point at (which are verified on the way)."""
    try:
        with SegmentReader(seg_dir, sealer.signed) as segs:
            man = read_manifest(segs, sealer, manifest, epoch)
            if man.envelope is not None:
                return man.envelope.listing
            refs = index.view(epoch)
            tags = read_tags(segs, sealer, refs, epoch)
    except PageCorrupt as exc:
        raise StoreError(f"epoch {epoch}, the base of the next epoch, cannot be read ({exc.summary}); "
                         f"checkpoint a full capture (base 0) instead") from exc
    listing: Listing = {}
    for ref in refs:
        listing.setdefault(ref.region, {})[ref.index] = (ref.rec_epoch, tags[ref.region][ref.index])  # type: ignore
    return listing
