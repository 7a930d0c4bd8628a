"""The read side of a Store's epochs: the epoch list, names, and loading an epoch's view or its
manifest, every record verified (loading.py); a damaged index is rebuilt once, then read again.

Threading: every read takes only the state lock (never the writer lock): it never waits for
record appends or segment fsyncs, and a long load delays only the next commit.
"""
from __future__ import annotations

from typing import Callable

from . import loading
from .errors import IndexStale, PageCorrupt
from .healing import Healer
from .info import EpochInfo
from .loading import Pages
from .reader import read_manifest
from .segments import SegmentReader
from .shared import Shared


class EpochReads:
    """Store.epochs, latest_epoch, resolve, load_epoch, load_manifest, load_newest_valid."""

    def __init__(self, shared: Shared, heal: Healer):
        self._shared, self._heal = shared, heal

    def epochs(self) -> list[EpochInfo]:
        return self._heal.reading(lambda: self._shared.index.epochs())

    def latest(self) -> int | None:
        return self._heal.reading(lambda: self._shared.index.latest())

    def resolve(self, epoch_or_name: int | str) -> int:
        return self._heal.reading(lambda: self._resolve(epoch_or_name))

    def _resolve(self, epoch_or_name: int | str) -> int:
        index, found = self._shared.index, None
        if isinstance(epoch_or_name, int) and not isinstance(epoch_or_name, bool):
            found = epoch_or_name if index.manifest_ref(epoch_or_name) else None
        elif isinstance(epoch_or_name, str):
            found = index.by_name(epoch_or_name)
            if found is None and epoch_or_name.strip().isdigit():
                found = int(epoch_or_name) if index.manifest_ref(int(epoch_or_name)) else None
        if found is None:
            raise self._shared.unknown(epoch_or_name)
        return found

    def load(self, epoch: int, max_page_bytes: int | None, max_manifest_bytes: int | None,
             only: frozenset[tuple[str, int]] | None = None) -> tuple[bytes, Pages]:
        sh = self._shared

        def read(rebuilt: bool) -> tuple[bytes, Pages]:
            manifest = sh.index.manifest_ref(epoch)
            if manifest is None:
                raise sh.unknown(epoch)
            with SegmentReader(sh.seg_dir, sh.sealer.signed) as segs:
                try:
                    return loading.load(sh.index, segs, sh.sealer, sh.ident(), manifest, epoch, max_page_bytes,
                                        max_manifest_bytes=max_manifest_bytes, only=only)
                except PageCorrupt as exc:
                    if rebuilt or not loading.misplaced(sh.index, sh.seg_dir, sh.sealer, exc):
                        raise
                    raise IndexStale(f"{exc.summary}; the index, not the log, looks wrong") from exc
        return self._heal.reading_told(read)

    def manifest(self, epoch: int, max_bytes: int | None) -> bytes:
        sh = self._shared

        def read() -> bytes:
            manifest = sh.index.manifest_ref(epoch)
            if manifest is None:
                raise sh.unknown(epoch)
            with SegmentReader(sh.seg_dir, sh.sealer.signed) as segs:
                return loading.manifest(segs, sh.sealer, sh.ident(), manifest, epoch, max_bytes)
        return self._heal.reading(read)

    def view(self, epoch: int) -> dict[str, dict[int, int]]:
        sh = self._shared

        def read() -> dict[str, dict[int, int]]:
            manifest = sh.index.manifest_ref(epoch)
            if manifest is None:
                raise sh.unknown(epoch)
            with SegmentReader(sh.seg_dir, sh.sealer.signed) as segs:
                env = read_manifest(segs, sh.sealer, manifest, epoch, sh.store_id, sh.legacy_until).envelope
            if env is not None:   # the log's word, verified by the envelope's tag
                return {r: {i: e for i, (e, _) in pages.items()} for r, pages in env.listing.items()}
            view: dict[str, dict[int, int]] = {}   # a bare manifest (before format 3): the index's word
            for ref in sh.index.view(epoch):
                view.setdefault(ref.region or "", {})[ref.index or 0] = ref.rec_epoch
            return view
        return self._heal.reading(read)

    def newest_valid(self, accept: Callable[[int, bytes], None] | None, max_page_bytes: int | None,
                     max_manifest_bytes: int | None) -> tuple[int, bytes, Pages, list[str]] | None:
        sh = self._shared

        def read(rebuilt: bool) -> tuple[int, bytes, Pages, list[str]] | None:
            with SegmentReader(sh.seg_dir, sh.sealer.signed) as segs:
                return loading.newest_valid(sh.index, segs, sh.sealer, sh.ident(), accept, max_page_bytes,
                                            suspect=not rebuilt, max_manifest_bytes=max_manifest_bytes)
        return self._heal.reading_told(read)
