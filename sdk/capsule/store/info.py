"""Plain values the store hands out and passes between its modules (all immutable)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .records import KIND_MANIFEST, KIND_PAGE
from .segments import Position


@dataclass(frozen=True)
class EpochInfo:
    """One committed epoch. bytes_written: record bytes this epoch appended (pages + manifest);
    n_pages: pages written by this epoch (its delta, not its full view); base: the epoch its delta
    applies to (0: none)."""
    id: int
    name: str | None
    created: float
    bytes_written: int
    n_pages: int
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    base: int = 0


@dataclass(frozen=True)
class VerifyReport:
    """Result of Store.verify(): ok is True only when no problem at all was found."""
    ok: bool
    epochs_ok: tuple[int, ...]
    epochs_bad: tuple[int, ...]
    records: int
    bytes: int
    problems: tuple[str, ...]
    records_bad: tuple[tuple[str, int], ...] = ()   # (collection, id) of keyed records damaged or missing


@dataclass(frozen=True)
class PageRef:
    """Where one record lies, and what its header must say. region None: a manifest record.
    segment None: a tombstone (the page is absent from this epoch's view). kind 0: derived from
    region (manifest / page); a keyed record's ref says KIND_RECORD (region = collection, rec_epoch = version, index = id)."""
    region: str | None
    index: int | None
    rec_epoch: int
    segment: int | None
    offset: int | None
    length: int | None
    kind: int = 0

    @property
    def record_kind(self) -> int:
        return self.kind or (KIND_MANIFEST if self.region is None else KIND_PAGE)

    @property
    def location(self) -> tuple[int | None, int | None]:
        return self.segment, self.offset


@dataclass(frozen=True)
class Head:
    """The last record committed to the log (kept in the index's meta, checked at open): where it
    lies and its tag. An index whose head is not the log's last committed record is stale."""
    segment: int
    offset: int
    length: int
    tag: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class StagedEpoch:
    """An epoch appended but not committed: its index rows, waiting for sync()."""
    info: EpochInfo
    manifest: PageRef
    rows: tuple[PageRef, ...]   # written pages, then alias / tombstone rows restoring `base`
    start: Position             # where its first record went (rollback point)
