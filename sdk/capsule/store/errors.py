"""Errors the store raises. Each message names the store, the record and what to do next."""
from __future__ import annotations

from ..errors import CapsuleCorrupt, StoreError


class StoreLocked(StoreError):
    """Another process holds the store's LOCK (it is open for writing there)."""


class SigningKeyError(StoreError):
    """The store is signed and no key / the wrong key was given, or a key was given to an unsigned store."""


class StoreIOError(StoreError):
    """A write, fsync or index commit failed; nothing of the failed epochs was committed."""


class UnsafeStore(StoreError):
    """An entry of the store folder is a symbolic link, or not a regular file where the store keeps
    one (a FIFO, a folder, a socket, a device): the store refuses it rather than follow or block."""


class UnknownEpoch(StoreError, KeyError):
    """An epoch id or name that the store does not hold (never committed, or dropped by retention)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownRecord(StoreError, KeyError):
    """A keyed record id the store does not hold (never put, or forgotten: ids are never reused)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class IndexCorrupt(CapsuleCorrupt):
    """index.sqlite is missing, truncated or garbage while segment data exists."""


class IndexStale(IndexCorrupt):
    """The index disagrees with the log (an epoch's envelope lists other records than the index
    rows name, or the log holds commits the index lacks): the store rebuilds it from the segments."""


class PageCorrupt(CapsuleCorrupt):
    """One record failed verification. `epoch` is the epoch that wrote the record; `loading` the
    epoch being read when it was found. region/index are None for a manifest record."""

    def __init__(self, epoch: int, region: str | None, index: int | None, segment: int, offset: int,
                 reason: str, *, loading: int | None = None):
        self.epoch, self.region, self.index = epoch, region, index
        self.segment, self.offset, self.reason = segment, offset, reason
        self.loading = epoch if loading is None else loading
        self.length: int | None = None   # the record length the index row claims, when known
        super().__init__(f"{self.summary}. Older epochs that do not use this record may still load "
                         f"(Store.load_newest_valid); `capsule verify` lists all damage")

    @property
    def summary(self) -> str:
        what = "manifest" if self.region is None else f"page {self.region}[{self.index}]"
        return (f"epoch {self.loading}: {what} written by epoch {self.epoch} (segment {self.segment:06d}, "
                f"offset {self.offset}) is corrupt: {self.reason}")

    def __reduce__(self):  # picklable across processes despite the keyword-only argument
        return (_rebuild_page_corrupt, (self.epoch, self.region, self.index, self.segment, self.offset,
                                        self.reason, self.loading))


class RecordCorrupt(PageCorrupt):
    """A keyed record failed verification: region is its collection, index its id, epoch 0 (keyed
    records belong to no epoch); `version` is the version the index expects."""

    def __init__(self, collection: str, record_id: int, version: int, segment: int, offset: int, reason: str):
        self.epoch, self.region, self.index, self.loading, self.version = 0, collection, record_id, 0, version
        self.segment, self.offset, self.reason = segment, offset, reason
        CapsuleCorrupt.__init__(self, f"{self.summary}. Other records and every epoch are unaffected; put it "
                                      f"again or forget it; `capsule verify` lists all damage")

    @property
    def record_id(self) -> int:
        return self.index  # type: ignore[return-value]

    @property
    def summary(self) -> str:
        return (f"{self.region} {self.index}: its record (version {self.version}, segment {self.segment:06d}, "
                f"offset {self.offset}) is corrupt: {self.reason}")

    def __reduce__(self):
        return (type(self), (self.region, self.index, self.version, self.segment, self.offset, self.reason))


class RecordRowCorrupt(CapsuleCorrupt):
    """A keyed record's index row is damaged (a column fails its declared type or bounds), or
    differs from the row its record holds. `collection`, `record_id` and `reason` say which and why."""

    def __init__(self, collection: str, record_id: int, reason: str):
        self.collection, self.record_id, self.reason = collection, record_id, reason
        super().__init__(f"{collection} {record_id}: its index row is damaged: {reason}. Other records and every "
                         f"epoch are unaffected; `capsule repair` rebuilds the row from its record, or forget "
                         f"it; `capsule verify` lists all damage")

    def __reduce__(self):
        return (type(self), (self.collection, self.record_id, self.reason))


def _rebuild_page_corrupt(*args) -> PageCorrupt:
    *head, loading = args
    return PageCorrupt(*head, loading=loading)


__all__ = ["StoreError", "CapsuleCorrupt", "StoreLocked", "SigningKeyError", "StoreIOError", "UnsafeStore",
           "UnknownEpoch", "UnknownRecord", "IndexCorrupt", "IndexStale", "PageCorrupt",
           "RecordCorrupt", "RecordRowCorrupt"]
