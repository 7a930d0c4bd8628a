"""Store: the commit protocol and recovery over segments (records) and index.sqlite (page map).

Commit protocol: append records -> fsync the segments (+ the folder when a file was created)
-> one SQLite transaction (THE commit point). Recovery cuts the active segment back to its
committed end. See docs/FORMAT.md.

A facade over composed parts sharing one Shared (shared.py): the committer (commit.py), the epoch
reads (epochreads.py), the keyed records (keyed.py: a caller's typed row plus an opaque blob,
outside epochs), healing a damaged index (healing.py) and upkeep (upkeep.py).

Threading: a Store may be shared by threads. Writers (stage_epoch, sync, write_epoch, retain,
compact, close, and the keyed-record writers) are serialized by a writer lock; readers (epochs,
latest_epoch, resolve, load_epoch, load_newest_valid, stats, the keyed-record readers) take only the
state lock, which a writer holds just for its index transaction: readers never wait for record
appends or segment fsyncs, and a long load delays only the next commit. verify() holds both locks.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import StoreError
from . import lockfile, maintenance
from .commit import Committer
from .epochreads import EpochReads
from .folder import OWNED, folder_path, holds_store
from .healing import Healer
from .info import EpochInfo, VerifyReport
from .inputs import PageStream
from .keyed import Keyed, Record
from .keyedrows import Collection, StoredRow
from .loading import Pages
from .opening import Opened, open_index
from .records import Sealer
from .segments import FileOps
from .shared import Shared
from .upkeep import Upkeep


class Store:
    """A durable, crash-consistent, append-only page store (bytes in, bytes out), which also keeps
    keyed records (put_record, record, records, forget_record, ...: see keyed.py). Use Store.open."""

    def __init__(self, path: Path, opened: Opened, sealer: Sealer, fs: FileOps, segment_bytes: int,
                 lock_fd: int):
        self.path = path
        sh = self._shared = Shared(path, opened, sealer, fs, lock_fd)
        self._wlock = sh.wlock
        self._commit = Committer(path, opened.index, sealer, fs, segment_bytes, sh.lock, opened.store_id,
                                 self.repair)
        # what recovery did at open (index rebuilt, bytes cut or set aside in quarantine/): logged
        # as warnings too; empty after a clean open
        self.recovery_report: list[str] = sh.report
        self._keyed = Keyed(path, sh.seg_dir, sealer, self._commit, sh.wlock, sh.lock, lambda: sh.index,
                            sh.check_open)
        self._heal = Healer(sh, self._commit, self._keyed)
        self._reads = EpochReads(sh, self._heal)
        self._upkeep = Upkeep(sh, self._commit, self._heal)
        self._listeners: list[Callable[[list[EpochInfo]], None]] = []

    # -- lifetime -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = True, sign_key: bytes | None = None,
             segment_bytes: int = 64 << 20, fs: FileOps | None = None) -> "Store":
        """Open (or create) the store folder, take its LOCK and recover. O(1) in history length."""
        if not isinstance(segment_bytes, int) or not 4096 <= segment_bytes <= 1 << 40:
            raise ValueError(f"segment_bytes must be an int in 4096..2**40, got {segment_bytes!r}")
        sealer = Sealer(sign_key)
        path = folder_path(path, create)
        # a failed open of a NEW store removes what it added (folder, LOCK, index files, segments/)
        folder = lockfile.lock_folder(path, is_new=lambda: not holds_store(path), owned=OWNED)
        try:
            seg_dir = path / "segments"
            seg_dir.mkdir(mode=0o700, exist_ok=True)
            fs = fs or FileOps()
            try:
                opened = open_index(path, sealer, fs, create=create)
            except OSError as exc:
                raise StoreError(f"store {path} could not be recovered: {exc}") from exc
            try:
                store = cls(path, opened, sealer, fs, segment_bytes, folder.fd)
                store._recover()
                return store
            except OSError as exc:
                opened.index.close()
                raise StoreError(f"store {path} could not be recovered: {exc}") from exc
            except BaseException:
                opened.index.close()
                raise
        except BaseException:
            folder.abandon()
            raise

    def _recover(self) -> None:
        sh = self._shared
        with sh.lock:
            maintenance.delete_dead_segments(sh.index, sh.fs, sh.seg_dir)
        self._commit.reset_to_committed()

    def close(self) -> None:
        """Release the lock. Staged epochs that were not synced are discarded (never acknowledged)."""
        sh = self._shared
        with sh.wlock, sh.lock:
            if sh.lock_fd is None:
                return
            try:
                self._commit.discard()
            finally:
                sh.index.close()
                lockfile.release(sh.lock_fd)
                sh.lock_fd = None

    @property
    def store_id(self) -> str:
        """This store's id (uuid4 hex, meta.store_id): every record and envelope names it."""
        return self._shared.store_id

    def on_commit(self, listener: Callable[[list[EpochInfo]], None]) -> Callable[[], None]:
        """Call listener(epochs) after each write_epoch / sync that committed epochs, on the
        committing thread with the writer lock held: it must return at once (set an event) and
        never call the store's writers. Returns the function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _committed(self, infos: list[EpochInfo]) -> list[EpochInfo]:
        for listener in list(self._listeners) if infos else ():
            listener(infos)
        return infos

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- write ----------------------------------------------------------------------------------
    def write_epoch(self, pages: Iterable[tuple[str, int, Any]] | PageStream, manifest: bytes, *,
                    name: str | None = None, meta: dict | None = None,
                    base: int | None = None) -> EpochInfo:
        """Append and commit one epoch (plus any staged ones). Durable when it returns.
        pages: (region, index, bytes) tuples, or a PageStream (bytes made as they are written)."""
        with self._wlock:
            self._shared.check_open()
            self._heal.writing(lambda: self._commit.stage(pages, manifest, name, meta, base))
            return self._committed(self._commit.sync())[-1]

    def stage_epoch(self, pages: Iterable[tuple[str, int, Any]] | PageStream, manifest: bytes, *,
                    name: str | None = None, meta: dict | None = None,
                    base: int | None = None) -> int:
        """Append an epoch's records without fsync or commit; returns the id sync() will commit it as.
        base: the epoch this delta applies to (default: the previous one; 0: an empty view)."""
        with self._wlock:
            self._shared.check_open()
            return self._heal.writing(lambda: self._commit.stage(pages, manifest, name, meta, base)).info.id

    def sync(self) -> list[EpochInfo]:
        """Group commit: one fsync pass + one transaction for every staged epoch, oldest first."""
        with self._wlock:
            self._shared.check_open()
            return self._committed(self._commit.sync())

    def discard_staged(self) -> list[int]:
        """Drop staged, unsynced epochs and cut their bytes (a writer whose batch failed midway
        must not leave half a batch staged for the next sync to commit). Returns their ids."""
        with self._wlock:
            return self._commit.drop_staged()

    def repair(self, why: str = "asked for (Store.repair)",
               progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Rebuild index.sqlite from the segment log (the old index files go to quarantine/);
        returns what was done (also appended to recovery_report). Epochs whose records are all
        intact come back, with keyed records and forgets; nothing in the segments is changed. Staged,
        unsynced epochs are discarded first. progress(done, total) is called per segment scanned."""
        return self._heal.repair(why, progress)

    # -- read (epochreads.py) -------------------------------------------------------------------
    def epochs(self) -> list[EpochInfo]:
        """Committed, retained epochs, oldest first."""
        return self._reads.epochs()

    def latest_epoch(self) -> int | None:
        return self._reads.latest()

    def resolve(self, epoch_or_name: int | str) -> int:
        """The id of a retained epoch given its id or name (a str of digits is tried as an id too)."""
        return self._reads.resolve(epoch_or_name)

    def load_epoch(self, epoch: int, *, max_page_bytes: int | None = None,
                   max_manifest_bytes: int | None = None,
                   only: Iterable[tuple[str, int]] | None = None) -> tuple[bytes, Pages]:
        """(manifest, {region: {index: page}}): the epoch's full view, every record verified
        (and, for an epoch with an envelope, exactly the records it lists: an index that says
        otherwise is rebuilt from the log first). max_page_bytes: refuse (PageCorrupt) a page
        whose record claims a bigger payload, before anything is read or allocated for it;
        max_manifest_bytes likewise for the caller's manifest. only: read just these
        (region, index) of the view (those it lacks are absent), e.g. the pages of view()
        written since some epoch."""
        wanted = None if only is None else frozenset(only)
        return self._reads.load(epoch, max_page_bytes, max_manifest_bytes, wanted)

    def view(self, epoch: int) -> dict[str, dict[int, int]]:
        """{region: {index: the epoch that wrote the page}}: every page of the epoch's view, read
        from its verified envelope, no page read. Pages whose writing epoch is newer than some
        epoch B are exactly what changed since B (how a replica learns a delta)."""
        return self._reads.view(epoch)

    def load_manifest(self, epoch: int, *, max_bytes: int | None = None) -> bytes:
        """An epoch's manifest alone (verified, and checked against its envelope), reading no page:
        for listings. PageCorrupt when its record is damaged; max_bytes refuses a bigger one unread."""
        return self._reads.manifest(epoch, max_bytes)

    def load_newest_valid(self, accept: Callable[[int, bytes], None] | None = None, *,
                          max_page_bytes: int | None = None, max_manifest_bytes: int | None = None
                          ) -> tuple[int, bytes, Pages, list[str]] | None:
        """Newest epoch whose every record verifies: (epoch, manifest, pages, skipped reports).
        None when the store holds no epoch; CapsuleCorrupt when it holds some and none is valid.
        (What recovery did at open, such as a rebuilt index, is in recovery_report.)

        accept(epoch, manifest): called before an epoch's pages are read; raising a CapsuleError
        (CapsuleCorrupt: the manifest is unreadable; CapsuleMismatch: it belongs to another
        model) skips the epoch, reported like a damaged one. When no epoch is valid and some
        were refused with CapsuleMismatch, the newest such CapsuleMismatch is raised.
        max_page_bytes / max_manifest_bytes: records claiming more are refused unread (skipped)."""
        return self._reads.newest_valid(accept, max_page_bytes, max_manifest_bytes)

    # -- keyed records (keyed.py; a damaged index is rebuilt once, then asked again) ------------
    def put_record(self, collection: Collection, row: dict[str, Any], blob: Any, *, cache: Any = None,
                   record_id: int | None = None) -> int:
        """Store a new record of `collection`: its row (exactly the declared columns, each of its type)
        and an opaque blob (at most 1 GiB); cache: an optional index-only blob (see set_record_cache).
        Returns its id (ids only grow, never reused). Durable when it returns; staged epochs commit first.
        record_id: this id instead of the next one (a copy keeping another store's ids); it must be
        one never used here (ValueError otherwise), and ids after it continue from it."""
        return self._heal.writing(lambda: self._keyed.put(collection, row, blob, cache, record_id))

    def replace_record(self, collection: Collection, record_id: int, row: dict[str, Any], blob: Any, *,
                       same: tuple[str, ...] = ()) -> None:
        """Write a new version of a record (row and blob); the old one becomes dead bytes for
        compaction. `same`: columns the caller carried over, which must equal the current record's
        (RecordRowCorrupt when the index's copy was edited since; a damaged or headless current
        record is not compared, since replacing it is the repair). Durable when it returns."""
        self._heal.writing(lambda: self._keyed.replace(collection, record_id, row, blob, tuple(same)))

    def set_record_cache(self, collection: Collection, record_id: int, cache: Any) -> None:
        """Set (None: clear) a record's cache: an opaque blob in the index only, 1 B .. 2 MiB, for
        what the caller derives from the row and can recompute (a rebuilt index has none)."""
        self._heal.writing(lambda: self._keyed.set_cache(collection, record_id, cache))

    def forget_record(self, collection: Collection, record_id: int) -> None:
        """Delete a record (UnknownRecord if there is none); compaction reclaims it. A small forget
        record goes to the log (durable when this returns), so a rebuilt index forgets it too."""
        self._heal.writing(lambda: self._keyed.forget(collection, record_id))

    def records(self, collection: Collection, ids: Iterable[int] | None = None) -> list[StoredRow]:
        """The rows of every record (or of those of `ids` that exist), ordered by id, each checked
        against the columns: a damaged one comes with row None and `damage` saying why."""
        wanted = None if ids is None else list(ids)
        return self._heal.reading(lambda: self._keyed.rows(collection, wanted))

    def record(self, collection: Collection, record_id: int) -> Record:
        """A record's row and blob, after checking its row and verifying its record (tag; kind / id /
        version / length equal the row; its row equal to the index's). A damaged or edited row raises
        RecordRowCorrupt; a damaged record RecordCorrupt (a PageCorrupt, region = the collection)."""
        return self._heal.reading(lambda: self._keyed.get(collection, record_id))

    def record_caches(self, collection: Collection) -> list[tuple[int, bytes]]:
        """(id, cache) of every record of the collection that has a cache, ordered by id."""
        return self._heal.reading(lambda: self._keyed.caches(collection))

    @property
    def record_generation(self) -> int:
        """A number that changes with every committed put / replace / forget of any keyed record and
        with every rebuilt index (not with caches or epochs): callers key their derived caches on it."""
        return self._keyed.generation

    def count_records(self, collection: Collection) -> int:
        """How many records the collection holds (damaged rows included)."""
        return self._heal.reading(lambda: self._keyed.count(collection))

    # -- maintenance (upkeep.py, maintenance.py) -----------------------------------------------
    def retain(self, keep: int) -> int:
        """Drop unnamed epochs older than the `keep` newest (named epochs stay); returns how many."""
        return self._upkeep.retain(keep)

    def compact(self, *, threshold: float = 0.5) -> int:
        """Move live records out of sealed segments less than `threshold` live; returns bytes reclaimed."""
        return self._upkeep.compact(threshold)

    def verify(self) -> VerifyReport:
        """Read and check every record of every segment and every index row (keyed records included)."""
        return self._upkeep.verify()

    def stats(self) -> dict[str, int | None]:
        return self._upkeep.stats()
