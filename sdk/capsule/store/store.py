"""Store: the commit protocol and recovery over segments (records) and index.sqlite (page map).

Commit protocol: append records -> fsync the segments (+ the folder when a file was created)
-> one SQLite transaction (THE commit point). Recovery cuts the active segment back to its
committed end. See docs/FORMAT.md.

It also keeps keyed records (keyed.py): a caller's typed row plus an opaque blob, outside epochs.

Threading: a Store may be shared by threads. Writers (stage_epoch, sync, write_epoch, retain,
compact, close, and the keyed-record writers) are serialized by a writer lock; readers (epochs,
latest_epoch, resolve, load_epoch, load_newest_valid, stats, the keyed-record readers) take only the
state lock, which a writer holds just for its index transaction: readers never wait for record
appends or segment fsyncs, and a long load delays only the next commit. verify() holds both locks.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import StoreError
from . import lockfile, maintenance
from .commit import Committer
from . import loading
from .errors import IndexCorrupt, IndexStale, PageCorrupt, UnknownEpoch
from .index import Index
from .info import EpochInfo, VerifyReport
from .keyed import Keyed, Record
from .keyedrows import Collection, StoredRow
from .loading import Pages
from .folder import OWNED, folder_path, holds_store
from .opening import Opened, held_by, open_index
from .records import Sealer
from .segments import FileOps, SegmentReader


class Store:
    """A durable, crash-consistent, append-only page store (bytes in, bytes out), which also keeps
    keyed records (put_record, record, records, forget_record, ...: see keyed.py). Use Store.open."""

    def __init__(self, path: Path, opened: Opened, sealer: Sealer, fs: FileOps, segment_bytes: int,
                 lock_fd: int):
        self.path, self._index, self._sealer, self._fs = path, opened.index, sealer, fs
        self._seg_dir = path / "segments"
        self._lock_fd: int | None = lock_fd
        self._wlock = threading.RLock()   # serializes writers; taken before _lock
        self._lock = threading.RLock()    # guards the index connection and segment deletion
        self._store_id, self._legacy_until = opened.store_id, opened.legacy_until
        self._commit = Committer(path, opened.index, sealer, fs, segment_bytes, self._lock, opened.store_id,
                                 self.repair)
        # what recovery did at open (index rebuilt, bytes cut or set aside in quarantine/): logged
        # as warnings too; empty after a clean open
        self.recovery_report: list[str] = list(opened.report)
        self._keyed = Keyed(path, self._seg_dir, sealer, self._commit, self._wlock, self._lock,
                            lambda: self._index, self._check_open)

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

    def close(self) -> None:
        """Release the lock. Staged epochs that were not synced are discarded (never acknowledged)."""
        with self._wlock, self._lock:
            if self._lock_fd is None:
                return
            try:
                self._commit.discard()
            finally:
                self._index.close()
                lockfile.release(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- write ----------------------------------------------------------------------------------
    def write_epoch(self, pages: Iterable[tuple[str, int, Any]], manifest: bytes, *, name: str | None = None,
                    meta: dict | None = None, base: int | None = None) -> EpochInfo:
        """Append and commit one epoch (plus any staged ones). Durable when it returns."""
        with self._wlock:
            self._check_open()
            self._writing(lambda: self._commit.stage(pages, manifest, name, meta, base))
            return self._commit.sync()[-1]

    def stage_epoch(self, pages: Iterable[tuple[str, int, Any]], manifest: bytes, *, name: str | None = None,
                    meta: dict | None = None, base: int | None = None) -> int:
        """Append an epoch's records without fsync or commit; returns the id sync() will commit it as.
        base: the epoch this delta applies to (default: the previous one; 0: an empty view)."""
        with self._wlock:
            self._check_open()
            return self._writing(lambda: self._commit.stage(pages, manifest, name, meta, base)).info.id

    def sync(self) -> list[EpochInfo]:
        """Group commit: one fsync pass + one transaction for every staged epoch, oldest first."""
        with self._wlock:
            self._check_open()
            return self._commit.sync()

    def discard_staged(self) -> list[int]:
        """Drop staged, unsynced epochs and cut their bytes (a writer whose batch failed midway
        must not leave half a batch staged for the next sync to commit). Returns their ids."""
        with self._wlock:
            ids = [s.info.id for s in self._commit.staged]
            if ids:
                self._commit.staged.clear()
                try:
                    self._commit.reset_to_committed()
                except OSError:
                    self._commit.poison()   # the next write cuts them first, or raises
            return ids

    def _recover(self) -> None:
        with self._lock:
            maintenance.delete_dead_segments(self._index, self._fs, self._seg_dir)
        self._commit.reset_to_committed()

    def repair(self, why: str = "asked for (Store.repair)",
               progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Rebuild index.sqlite from the segment log (the old index files go to quarantine/);
        returns what was done (also appended to recovery_report). Epochs whose records are all
        intact come back, with keyed records and forgets; nothing in the segments is changed. Staged,
        unsynced epochs are discarded first. progress(done, total) is called per segment scanned."""
        with self._wlock, self._lock:
            self._check_open()
            self.discard_staged()   # never synced, never acknowledged: cut, not adopted
            held = held_by(self._index)
            self._index.close()
            try:
                opened = open_index(self.path, self._sealer, self._fs, create=False, force_rebuild=why,
                                    progress=progress, held=held)
            except BaseException:
                self._index = Index.open(self.path / "index.sqlite", create=False, segments_exist=True)
                self._commit.attach_index(self._index)
                raise
            self._index = opened.index
            self._store_id, self._legacy_until = opened.store_id, opened.legacy_until
            self._commit.attach_index(opened.index, opened.store_id)
            self._commit.reset_to_committed()
            self.recovery_report += opened.report
            self._keyed.generation += 1
            return list(opened.report)

    def _repair_once(self, exc: IndexCorrupt, repaired: list[bool]) -> None:
        """A read found the index wrong: rebuild it, once per call (the second time, raise). A
        rebuild that refuses (the log cannot stand in for the index) leaves the index as it was:
        the read is done again without suspecting it, and falls back or fails as damage."""
        if repaired:
            raise exc
        repaired.append(True)
        try:
            self.repair(str(exc))
        except IndexCorrupt as refused:
            if not isinstance(exc, IndexStale):
                raise exc from refused       # the index itself cannot be read: nothing to fall back on
            self.recovery_report.append(f"the index could not be rebuilt from the log ({refused})")

    # -- read ---------------------------------------------------------------------------------
    def epochs(self) -> list[EpochInfo]:
        """Committed, retained epochs, oldest first."""
        return self._reading(self._index_epochs)

    def latest_epoch(self) -> int | None:
        return self._reading(lambda: self._index.latest())

    def resolve(self, epoch_or_name: int | str) -> int:
        """The id of a retained epoch given its id or name (a str of digits is tried as an id too)."""
        return self._reading(lambda: self._resolve(epoch_or_name))

    def _index_epochs(self) -> list[EpochInfo]:
        return self._index.epochs()

    def _resolve(self, epoch_or_name: int | str) -> int:
        found = None
        if isinstance(epoch_or_name, int) and not isinstance(epoch_or_name, bool):
            found = epoch_or_name if self._index.manifest_ref(epoch_or_name) else None
        elif isinstance(epoch_or_name, str):
            found = self._index.by_name(epoch_or_name)
            if found is None and epoch_or_name.strip().isdigit():
                found = int(epoch_or_name) if self._index.manifest_ref(int(epoch_or_name)) else None
        if found is None:
            raise UnknownEpoch(f"no epoch {epoch_or_name!r} in store {self.path}; {self._known()}")
        return found

    def _writing(self, write: Callable[[], Any]) -> Any:
        """Run an index step of a writer (before it appends anything, or all in one transaction),
        holding the writer lock; a damaged index is rebuilt once, then the step runs again."""
        repaired: list[bool] = []
        while True:
            try:
                return write()
            except IndexCorrupt as exc:
                self._repair_once(exc, repaired)

    def _locked(self, step: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return step(self._index, *args)

    def _reading(self, read: Callable[[], Any]) -> Any:
        """Run an index read under the state lock; a damaged index is rebuilt once, then read again."""
        repaired: list[bool] = []
        while True:
            try:
                with self._lock:
                    self._check_open()
                    return read()
            except IndexCorrupt as exc:
                self._repair_once(exc, repaired)

    def _known(self) -> str:
        infos = self._index.epochs()
        if not infos:
            return "it holds no epochs yet"
        ids = [e.id for e in infos]
        shown = ", ".join(map(str, ids if len(ids) <= 6 else ids[:3] + ["..."] + ids[-3:]))
        names = [repr(e.name) for e in infos if e.name][:5]
        return f"it holds epochs {shown}" + (f" (named: {', '.join(names)})" if names else "")

    def load_epoch(self, epoch: int, *, max_page_bytes: int | None = None,
                   max_manifest_bytes: int | None = None) -> tuple[bytes, Pages]:
        """(manifest, {region: {index: page}}): the epoch's full view, every record verified
        (and, for an epoch with an envelope, exactly the records it lists: an index that says
        otherwise is rebuilt from the log first). max_page_bytes: refuse (PageCorrupt) a page
        whose record claims a bigger payload, before anything is read or allocated for it;
        max_manifest_bytes likewise for the caller's manifest."""
        repaired: list[bool] = []
        while True:
            try:
                with self._lock:
                    self._check_open()
                    manifest = self._index.manifest_ref(epoch)
                    if manifest is None:
                        raise UnknownEpoch(f"no epoch {epoch!r} in store {self.path}; {self._known()}")
                    with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
                        try:
                            return loading.load(self._index, segs, self._sealer, self._ident(), manifest, epoch,
                                                max_page_bytes, max_manifest_bytes=max_manifest_bytes)
                        except PageCorrupt as exc:
                            if repaired or not loading.misplaced(self._index, self._seg_dir, self._sealer, exc):
                                raise
                            raise IndexStale(f"{exc.summary}; the index, not the log, looks wrong") from exc
            except IndexCorrupt as exc:
                self._repair_once(exc, repaired)

    def load_manifest(self, epoch: int, *, max_bytes: int | None = None) -> bytes:
        """An epoch's manifest alone (verified, and checked against its envelope), reading no page:
        for listings. PageCorrupt when its record is damaged; max_bytes refuses a bigger one unread."""
        def read() -> bytes:
            manifest = self._index.manifest_ref(epoch)
            if manifest is None:
                raise UnknownEpoch(f"no epoch {epoch!r} in store {self.path}; {self._known()}")
            with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
                return loading.manifest(segs, self._sealer, self._ident(), manifest, epoch, max_bytes)
        return self._reading(read)

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
        repaired: list[bool] = []
        while True:
            try:
                with self._lock:
                    self._check_open()
                    with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
                        return loading.newest_valid(self._index, segs, self._sealer, self._ident(), accept,
                                                    max_page_bytes, suspect=not repaired,
                                                    max_manifest_bytes=max_manifest_bytes)
            except IndexCorrupt as exc:
                self._repair_once(exc, repaired)

    def _ident(self) -> loading.Ident:
        return loading.Ident(self._store_id, self._legacy_until, self._seg_dir)

    # -- keyed records (keyed.py; a damaged index is rebuilt once, then asked again) ------------
    def put_record(self, collection: Collection, row: dict[str, Any], blob: Any, *, cache: Any = None) -> int:
        """Store a new record of `collection`: its row (exactly the declared columns, each of its type)
        and an opaque blob (at most 1 GiB); cache: an optional index-only blob (see set_record_cache).
        Returns its id (ids only grow, never reused). Durable when it returns; staged epochs commit first."""
        return self._writing(lambda: self._keyed.put(collection, row, blob, cache))

    def replace_record(self, collection: Collection, record_id: int, row: dict[str, Any], blob: Any, *,
                       same: tuple[str, ...] = ()) -> None:
        """Write a new version of a record (row and blob); the old one becomes dead bytes for
        compaction. `same`: columns the caller carried over, which must equal the current record's
        (RecordRowCorrupt when the index's copy was edited since; a damaged or headless current
        record is not compared, since replacing it is the repair). Durable when it returns."""
        self._writing(lambda: self._keyed.replace(collection, record_id, row, blob, tuple(same)))

    def set_record_cache(self, collection: Collection, record_id: int, cache: Any) -> None:
        """Set (None: clear) a record's cache: an opaque blob in the index only, 1 B .. 2 MiB, for
        what the caller derives from the row and can recompute (a rebuilt index has none)."""
        self._writing(lambda: self._keyed.set_cache(collection, record_id, cache))

    def forget_record(self, collection: Collection, record_id: int) -> None:
        """Delete a record (UnknownRecord if there is none); compaction reclaims it. A small forget
        record goes to the log (durable when this returns), so a rebuilt index forgets it too."""
        self._writing(lambda: self._keyed.forget(collection, record_id))

    def records(self, collection: Collection, ids: Iterable[int] | None = None) -> list[StoredRow]:
        """The rows of every record (or of those of `ids` that exist), ordered by id, each checked
        against the columns: a damaged one comes with row None and `damage` saying why."""
        wanted = None if ids is None else list(ids)
        return self._reading(lambda: self._keyed.rows(collection, wanted))

    def record(self, collection: Collection, record_id: int) -> Record:
        """A record's row and blob, after checking its row and verifying its record (tag; kind / id /
        version / length equal the row; its row equal to the index's). A damaged or edited row raises
        RecordRowCorrupt; a damaged record RecordCorrupt (a PageCorrupt, region = the collection)."""
        return self._reading(lambda: self._keyed.get(collection, record_id))

    def record_caches(self, collection: Collection) -> list[tuple[int, bytes]]:
        """(id, cache) of every record of the collection that has a cache, ordered by id."""
        return self._reading(lambda: self._keyed.caches(collection))

    @property
    def record_generation(self) -> int:
        """A number that changes with every committed put / replace / forget of any keyed record and
        with every rebuilt index (not with caches or epochs): callers key their derived caches on it."""
        return self._keyed.generation

    def count_records(self, collection: Collection) -> int:
        """How many records the collection holds (damaged rows included)."""
        return self._reading(lambda: self._keyed.count(collection))

    # -- maintenance (see maintenance.py) ---------------------------------------------------------
    def retain(self, keep: int) -> int:
        """Drop unnamed epochs older than the `keep` newest (named epochs stay); returns how many."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        with self._wlock:
            self._check_open()
            return self._writing(lambda: self._locked(maintenance.retain, keep))

    def compact(self, *, threshold: float = 0.5) -> int:
        """Move live records out of sealed segments less than `threshold` live; returns bytes reclaimed."""
        with self._wlock:
            self._check_open()
            self._commit.sync()  # staged bytes must not sit between compaction's copies
            try:
                return maintenance.compact(self._index, self._commit.writer, self._fs, self._seg_dir,
                                           self._sealer, self._lock, threshold)
            except (OSError, StoreError) as exc:
                self._commit.fail(exc, "compaction")

    def verify(self) -> VerifyReport:
        """Read and check every record of every segment and every index row (keyed records included)."""
        with self._wlock, self._lock:
            self._check_open()
            try:
                return maintenance.verify(self._index, self._seg_dir, self._sealer)
            except IndexCorrupt as exc:   # reported, not repaired: verify only looks
                return VerifyReport(False, (), (), 0, 0, (f"index: {exc}; `capsule repair` rebuilds it from "
                                                          f"the segment log",))

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            self._check_open()
            return maintenance.stats(self._index, self.path)

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise StoreError(f"store {self.path} is closed")
