"""capsule.store: a durable, crash-consistent, append-only page store (bytes in, bytes out).

It knows nothing of models: an epoch is an opaque manifest plus a map (region, index) -> page
bytes, written as a delta over the previous epoch; a keyed record is a caller's small typed row
(columns it declares in a Collection) plus an opaque blob. Format and protocol: docs/FORMAT.md.
"""
from .errors import (CapsuleCorrupt, IndexCorrupt, PageCorrupt, RecordCorrupt, RecordRowCorrupt, SigningKeyError,
                     StoreError, StoreIOError, StoreLocked, UnknownEpoch, UnknownRecord, UnsafeStore)
from .info import EpochInfo, VerifyReport
from .inputs import PageStream
from .keyed import Record
from .keyedrows import Collection, StoredRow
from .segments import FileOps
from .store import Store

__all__ = ["Store", "PageStream", "EpochInfo", "VerifyReport", "FileOps", "Collection", "Record", "StoredRow", "StoreError",
           "CapsuleCorrupt", "StoreLocked", "SigningKeyError", "StoreIOError", "UnsafeStore", "UnknownEpoch",
           "UnknownRecord", "IndexCorrupt", "PageCorrupt", "RecordCorrupt", "RecordRowCorrupt"]
