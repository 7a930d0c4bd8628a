"""Keyed records on the Store: a caller's small typed row plus an opaque blob, outside any epoch.

The store knows nothing of what they mean: a caller declares a Collection (its name and typed
columns) and puts rows with blobs; ids are per collection and never reused. A write (put,
replace, forget) follows the epoch commit protocol through Committer.commit_record: staged epochs
commit first, then append the record -> fsync -> ONE index transaction, so it is durable when it
returns. The record holds its row (keyedrecord.py), so a rebuilt index gets the row back, and a
forget leaves a forget record, so a rebuilt index forgets it too. The index-only `cache` blob is
the caller's to recompute (a rebuilt index has none). Rows read back are checked (keyedrows.py).
Writers hold the writer lock; readers only the state lock. Format: docs/FORMAT.md, "Keyed records".
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from .. import safejson
from . import keyeddb, keyedrecord
from .errors import RecordCorrupt, RecordRowCorrupt, UnknownRecord
from .inputs import as_bytes_view
from .keyedrows import Collection, StoredRow, check_cache, check_row, location_damage, record_id
from .reader import check_record, check_ref
from .records import KIND_FORGET, KIND_RECORD, MAX_EPOCH, RecordError, Sealer
from .segments import SegmentReader

if TYPE_CHECKING:
    from .commit import Committer
    from .index import Index


class Record(NamedTuple):
    """A record read by id: its checked row, its blob, and whether the record is headless (written
    by an older SDK: it does not hold its row, so the row is the index's alone)."""
    id: int
    version: int
    row: dict[str, Any]
    blob: bytes
    headless: bool


class Keyed:
    """The keyed-record half of a Store, sharing its locks, committer, sealer and folder, and
    reading the store's current index through `index` (a rebuild replaces it)."""

    def __init__(self, path: Path, seg_dir: Path, sealer: Sealer, commit: Committer, wlock: threading.RLock,
                 lock: threading.RLock, index: Callable[[], Index], check_open: Callable[[], None]):
        self.path, self._seg_dir, self._sealer, self._commit = path, seg_dir, sealer, commit
        self._wlock, self._lock, self._current_index, self._check_open = wlock, lock, index, check_open
        self.generation = 0   # +1 per committed put / replace / forget and per rebuild: for callers' caches

    @property
    def _index(self) -> Index:
        return self._current_index()

    # -- write --------------------------------------------------------------------------------
    def put(self, coll: Collection, row: Any, blob: Any, cache: Any = None, at: int | None = None) -> int:
        row = check_row(_coll(coll), row)
        cache = check_cache(cache)
        data = keyedrecord.encode(self._commit.store_id, row, as_bytes_view(blob, "blob"))
        if at is not None and record_id(at) is None:
            raise ValueError(f"record_id must be an int >= 1, got {at!r}")
        with self._wlock:
            self._check_open()
            with self._lock:
                rid = keyeddb.next_id(self._index, coll.name)
                if at is not None and at < rid:
                    raise ValueError(f"{coll.name} {at} is, or was, used in store {self.path}: ids are never "
                                     f"reused (the lowest free one is {rid})")
                rid = rid if at is None else at
            self._commit.commit_record(
                KIND_RECORD, 1, coll.name, rid, data, f"writing {coll.name} {rid}",
                lambda c, ref: keyeddb.put(c, coll.name, rid, row, ref, cache))
            self.generation += 1
            return rid

    def replace(self, coll: Collection, record: Any, row: Any, blob: Any, same: tuple[str, ...]) -> None:
        row = check_row(_coll(coll), row)
        rid = self._known_id(coll, record)
        view = as_bytes_view(blob, "blob")
        with self._wlock:
            self._check_open()
            with self._lock:
                ref = keyeddb.location(self._index, coll.name, rid)
                if ref is None:
                    raise self._unknown(coll, rid)
                why = self._differs(coll, ref, row, same)
            if why:
                raise RecordRowCorrupt(coll.name, rid, why)
            version = ref.rec_epoch if 1 <= ref.rec_epoch < MAX_EPOCH else 0
            if not version:
                raise ValueError(f"{coll.name} {rid} was replaced {ref.rec_epoch} times; put it as a new record")
            data = keyedrecord.encode(self._commit.store_id, row, view)
            self._commit.commit_record(
                KIND_RECORD, version + 1, coll.name, rid, data, f"replacing {coll.name} {rid}",
                lambda c, new: keyeddb.put(c, coll.name, rid, row, new))
            self.generation += 1

    def set_cache(self, coll: Collection, record: Any, cache: Any) -> None:
        rid = self._known_id(coll, record)
        blob = check_cache(cache)
        with self._wlock, self._lock:
            self._check_open()
            if not keyeddb.exists(self._index, coll.name, rid):
                raise self._unknown(coll, rid)
            self._index.write(f"setting the cache of {coll.name} {rid}",
                              lambda c: keyeddb.set_cache(c, coll.name, rid, blob))

    def forget(self, coll: Collection, record: Any) -> None:
        rid = self._known_id(coll, record)
        with self._wlock:
            self._check_open()
            with self._lock:
                if not keyeddb.exists(self._index, coll.name, rid):
                    raise self._unknown(coll, rid)
            self._commit.commit_record(
                KIND_FORGET, 1, coll.name, rid, safejson.dumps({"store": self._commit.store_id}),
                f"forgetting {coll.name} {rid}", lambda c, ref: keyeddb.forget(c, coll.name, rid, ref))
            self.generation += 1

    # -- read ---------------------------------------------------------------------------------
    def rows(self, coll: Collection, ids: Iterable[Any] | None) -> list[StoredRow]:
        wanted = None if ids is None else [i for i in map(record_id, ids) if i is not None]
        with self._lock:
            self._check_open()
            return keyeddb.stored(self._index, _coll(coll), wanted)

    def get(self, coll: Collection, record: Any) -> Record:
        rid = self._known_id(coll, record)
        with self._lock:
            self._check_open()
            found = keyeddb.stored(self._index, _coll(coll), [rid])
            if not found:
                raise self._unknown(coll, rid)
            if found[0].damage:
                raise RecordRowCorrupt(coll.name, rid, found[0].damage)
            ref = keyeddb.location(self._index, coll.name, rid)
            head, blob = keyedrecord_or_corrupt(self._payload(coll, ref), coll, ref)  # type: ignore[arg-type]
            if head is not None and _as_row(coll, head.row) != found[0].row:
                raise RecordRowCorrupt(coll.name, rid, _EDITED)
            return Record(rid, found[0].version, found[0].row, bytes(blob), head is None)  # the one copy out

    def caches(self, coll: Collection) -> list[tuple[int, bytes]]:
        with self._lock:
            self._check_open()
            return keyeddb.caches(self._index, coll.name)

    def count(self, coll: Collection) -> int:
        with self._lock:
            self._check_open()
            return keyeddb.count(self._index, coll.name)

    # -- helpers ------------------------------------------------------------------------------
    def _payload(self, coll: Collection, ref: Any) -> memoryview:
        """The payload of the verified record at ref (a view of the map; RecordCorrupt if bad)."""
        why = location_damage(ref.segment, ref.offset, ref.length)
        with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
            try:
                if why:
                    raise RecordError(f"the index row's record location is damaged ({why})")
                check_ref(ref)
                view = segs.view(ref.segment, ref.offset, ref.length)
                return check_record(view, ref, self._sealer)
            except RecordError as exc:
                raise RecordCorrupt(coll.name, ref.index, ref.rec_epoch, ref.segment or 0, ref.offset or 0,
                                    str(exc)) from None

    def _differs(self, coll: Collection, ref: Any, row: dict[str, Any], same: tuple[str, ...]) -> str | None:
        """Why row's `same` columns are not the current record's; None when they are, or when that
        cannot be told (a damaged or headless record: replacing it is the repair)."""
        try:
            head, _ = keyedrecord_or_corrupt(self._payload(coll, ref), coll, ref)
        except RecordCorrupt:
            return None
        if head is None:
            return None
        was = _as_row(coll, head.row) or {}
        bad = [c for c in same if was.get(c) != row.get(c)]
        return f"{', '.join(bad)}: {_EDITED}" if bad else None

    def _known_id(self, coll: Collection, record: Any) -> int:
        rid = record_id(record)
        if rid is None:
            with self._lock:
                self._check_open()
                raise self._unknown(coll, record)
        return rid

    def _unknown(self, coll: Collection, rid: Any) -> UnknownRecord:
        return UnknownRecord(f"no {coll.name} {rid!r} in store {self.path}: never put, or forgotten (ids are "
                             f"never reused); {keyeddb.describe(self._index, coll.name)}")


_EDITED = ("differs from the row its record was written with (the index was edited after the record was "
           "stored)")


def keyedrecord_or_corrupt(payload: memoryview, coll: Collection, ref: Any) -> tuple[Any, memoryview]:
    try:
        return keyedrecord.decode(payload)
    except RecordError as exc:
        raise RecordCorrupt(coll.name, ref.index, ref.rec_epoch, ref.segment, ref.offset, str(exc)) from None


def _as_row(coll: Collection, row: Any) -> dict[str, Any] | None:
    """A record head's row typed as the index row is (None when it does not fit the columns)."""
    try:
        return check_row(coll, row)
    except ValueError:
        return None


def _coll(coll: Any) -> Collection:
    if not isinstance(coll, Collection):
        raise ValueError(f"a collection is a capsule.store.Collection, got {type(coll).__name__}")
    return coll
