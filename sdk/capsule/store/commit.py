"""The commit protocol: append records -> fsync segments (+ folder on a new file) -> one SQLite
transaction, the commit point. Also the way back to the committed state after a failure or a
crash: cut every byte the index does not know about (rewind.py). A delta's base: deltas.py.

Threading: one Committer per Store, called with the Store's writer lock held; it takes the
state lock (`lock`) only around index access.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

from ..errors import StoreError
from . import deltas, envelope, rewind
from .envelope import Envelope, Listing
from .errors import IndexCorrupt, StoreIOError
from .index import Index
from .info import EpochInfo, Head, PageRef, StagedEpoch
from .inputs import as_bytes_view, check_meta, check_name, check_pages
from .records import KIND_EPOCH, KIND_PAGE, MAX_MANIFEST_BYTES, Sealer, encode_record
from .rewind import reason
from .segments import FileOps, Position, SegmentWriter


class Committer:
    """Owns the segment writer and the staged (appended, uncommitted) epochs."""

    def __init__(self, path: Path, index: Index, sealer: Sealer, fs: FileOps, segment_bytes: int,
                 lock: threading.RLock, store_id: str, repair: Callable[[str], object]):
        self.path, self._index, self._sealer, self._fs, self._lock = path, index, sealer, fs, lock
        self.store_id = store_id
        self._repair = repair   # rebuilds the index from the log (Store.repair)
        self.seg_dir = path / "segments"
        self.writer = SegmentWriter(self.seg_dir, fs, segment_bytes, sealer.signed)
        self.staged: list[StagedEpoch] = []
        self._poisoned = False  # a failed cleanup left bytes past the committed end
        # the listing of the newest staged or committed epoch: the next delta's base, unread
        self._listing: tuple[int, Listing] | None = None
        self._head: Head | None = None   # the last record appended (the log's head once committed)
        self._encoded: envelope.EncodeCache = {}

    def attach_index(self, index: Index, store_id: str | None = None) -> None:
        """After a rebuild: continue on the new index (nothing may be staged)."""
        self._index, self._listing = index, None
        self.staged.clear()
        if store_id is not None:
            self.store_id = store_id

    # -- staging ----------------------------------------------------------------------------------
    def stage(self, pages: Iterable, manifest: Any, name: str | None, meta: dict | None,
              base: int | None) -> StagedEpoch:
        self.heal()
        keys, items = check_pages(pages)   # a PageStream's bytes are made as they are appended
        man = as_bytes_view(manifest, "manifest")
        check_name(name)
        meta = check_meta(meta)
        with self._lock:
            epoch = (self._index.latest() or 0) + len(self.staged) + 1
            if name is not None and (self._index.by_name(name) is not None
                                     or any(s.info.name == name for s in self.staged)):
                raise ValueError(f"epoch name {name!r} is already used by a retained epoch; "
                                 f"names must be unique")
            aliases = deltas.base_rows(self._index, self.staged, epoch, base, keys,
                                       self.path)
            listing = dict(deltas.base_listing(self.seg_dir, self._sealer, self._index, self._listing, epoch,
                                               base, self.path))   # regions shared until written
            retained = envelope.runs([*self._index.epoch_ids(), *(s.info.id for s in self.staged), epoch])
        start, rows, touched = self.writer.position(), [], set()
        base_id = epoch - 1 if base is None else base
        try:
            for region, index, data in items:
                ref, tag = self._append(KIND_PAGE, epoch, region, index, data)
                rows.append(ref)
                if region not in touched:
                    listing[region] = dict(listing.get(region, {}))
                    touched.add(region)
                listing[region][index] = (epoch, tag)
            page_bytes = sum(r.length for r in rows)  # type: ignore[misc]
            env = Envelope(self.store_id, epoch, base_id, name, time.time(), meta, page_bytes, len(rows),
                           listing, bytes(man), retained)
            payload = envelope.encode(env, self._sealer.tag_bytes, self._encoded)
            if len(payload) > MAX_MANIFEST_BYTES:
                raise ValueError(f"epoch {epoch}'s manifest and page listing take {len(payload)} bytes; at most "
                                 f"{MAX_MANIFEST_BYTES} (use fewer, larger pages or a smaller manifest)")
            man_ref, _ = self._append(KIND_EPOCH, epoch, "", 0, payload)
            self.writer.flush()
        except OSError as exc:
            self._undo(start, exc, f"writing epoch {epoch}")
        except BaseException:
            self._undo_quietly(start)
            raise
        info = EpochInfo(epoch, name, env.created, page_bytes + man_ref.length, len(rows), meta,  # type: ignore
                         base_id)
        staged = StagedEpoch(info, PageRef(None, None, epoch, man_ref.segment, man_ref.offset, man_ref.length),
                             tuple(rows + aliases), start)
        self.staged.append(staged)
        self._listing = (epoch, listing)
        return staged

    def _append(self, kind: int, epoch: int, region: str, index: int, data: Any) -> tuple[PageRef, bytes]:
        parts = encode_record(self._sealer, kind, epoch, region, index, data)
        length = sum(len(p) for p in parts)
        segment, offset = self.writer.append(parts, length)
        self._head = Head(segment, offset, length, bytes(parts[2]))
        return PageRef(region, index, epoch, segment, offset, length), parts[2]

    # -- committing -------------------------------------------------------------------------------
    def sync(self) -> list[EpochInfo]:
        """One fsync pass + one index transaction for every staged epoch."""
        self.heal()
        if not self.staged:
            return []
        staged = list(self.staged)
        try:
            ends = self.writer.sync()
        except OSError as exc:
            self.fail(exc, "fsync")
        try:
            with self._lock:
                self._index.commit(staged, ends, self._head)
        except IndexCorrupt as exc:
            return self._commit_through_log(staged, exc)
        except StoreError as exc:
            self.fail(exc, "the index commit")
        self.staged.clear()
        self.writer.committed()
        return [s.info for s in staged]

    def _commit_through_log(self, staged: list[StagedEpoch], exc: IndexCorrupt) -> list[EpochInfo]:
        """The index broke at the commit point, after the epochs' records were synced: they are in
        the log, so the index rebuilt from it holds them (the log is the truth)."""
        self.staged.clear()
        self.writer.committed()
        ids = [s.info.id for s in staged]
        self._repair(f"committing epochs {ids}: {exc}")
        with self._lock:
            infos = {e.id: e for e in self._index.epochs() if e.id >= ids[0]}
        missing = [i for i in ids if i not in infos]
        if missing:
            raise StoreIOError(f"the index of store {self.path} broke while committing epochs {ids} and the "
                               f"index rebuilt from the log lacks {missing}; they were not committed") from exc
        return [infos[i] for i in ids]

    def commit_record(self, kind: int, epoch: int, region: str, index: int, data: Any, what: str,
                      apply: Callable[[sqlite3.Connection, PageRef], None]) -> PageRef:
        """One record outside any epoch (a keyed record), durable when this returns: staged epochs
        commit first (writer.sync covers every byte since the last commit, so they may not sit
        uncommitted before it), then append -> fsync -> ONE index transaction running
        apply(conn, ref) with the segments' new ends. On failure nothing of it stays."""
        self.sync()
        start = self.writer.position()
        try:
            ref, _ = self._append(kind, epoch, region, index, data)
            self.writer.flush()
        except OSError as exc:
            self._undo(start, exc, what)
        try:
            ends = self.writer.sync()
        except OSError as exc:
            self.fail(exc, f"fsync while {what}")
        try:
            with self._lock:
                self._index.write(what, lambda c: apply(c, ref), ends, self._head)
        except IndexCorrupt as exc:   # the record is synced: the index rebuilt from the log has it
            self.writer.committed()
            self._repair(f"{what}: {exc}")
            with self._lock:
                if (ref.segment, ref.offset, ref.length) not in self._index.live_records(ref.segment):
                    raise StoreIOError(f"the index of store {self.path} broke while {what}, and the index "
                                       f"rebuilt from the log does not hold it; it was not committed") from exc
            return ref
        except StoreError as exc:
            self.fail(exc, f"the index commit while {what}")
        self.writer.committed()
        return ref

    # -- failures and recovery -------------------------------------------------------------------
    def _undo(self, start: Position, exc: OSError, what: str) -> NoReturn:
        try:
            self.writer.rollback_to(start)
        except OSError as again:
            self.fail(exc, what, cleanup=again)
        raise StoreIOError(f"{what} to {self.path} failed: {reason(exc)}. Nothing of it was committed and the "
                           f"store stays usable; free space / fix the disk and write again") from exc

    def _undo_quietly(self, start: Position) -> None:
        """A non-I/O failure midway through staging (a limit found late): cut what it appended."""
        try:
            self.writer.rollback_to(start)
        except OSError:
            self._poisoned = True

    def fail(self, exc: BaseException, what: str, cleanup: OSError | None = None) -> NoReturn:
        """Discard every staged epoch, cut back to the committed state and raise StoreIOError."""
        ids = [s.info.id for s in self.staged]
        self.staged.clear()
        self._listing = None
        if cleanup is None:
            try:
                self.reset_to_committed()
            except OSError as again:
                cleanup = again
        self._poisoned = cleanup is not None
        lost = f" Staged epochs {ids} were not committed and are discarded." if ids else ""
        note = f" Cutting the uncommitted bytes failed too ({reason(cleanup)}); retried on the next write." \
            if cleanup else ""
        raise StoreIOError(f"{what} failed in store {self.path}: {reason(exc)}.{lost}{note} Committed epochs "
                           f"are intact and the store stays usable.") from exc

    def poison(self) -> None:
        """Uncommitted bytes could not be cut: the next write must cut them first."""
        self._poisoned = True

    def heal(self) -> None:
        """Before writing after a failed cleanup: cut the uncommitted bytes now (or raise again)."""
        if self._poisoned:
            try:
                self.reset_to_committed()
            except OSError as exc:
                raise StoreIOError(f"store {self.path} still cannot cut uncommitted bytes: "
                                   f"{reason(exc)}") from exc
            self._poisoned = False

    def reset_to_committed(self) -> None:
        """Make the files match the index: delete never-committed segment files, cut the active
        segment past its committed end, and append after it (or in a fresh file when committed
        bytes are missing: never write over what the index points at). See rewind.py."""
        self.writer.abandon()
        self._listing = None
        rewind.reset_to_committed(self.writer, self._index, self._lock, self._fs, self.seg_dir)

    def drop_staged(self) -> list[int]:
        """Drop staged, unsynced epochs and cut their bytes (a poisoned Committer when the cut
        fails: the next write cuts them first, or raises). Returns their ids."""
        ids = [s.info.id for s in self.staged]
        if ids:
            self.staged.clear()
            try:
                self.reset_to_committed()
            except OSError:
                self.poison()
        return ids

    def discard(self) -> None:
        """At close: drop staged epochs (never acknowledged) and cut their bytes, best effort."""
        try:
            if self.staged or self._poisoned:
                self.staged.clear()
                self.reset_to_committed()
        except OSError:
            pass  # the next open cuts the tail anyway
        finally:
            self.writer.abandon()
