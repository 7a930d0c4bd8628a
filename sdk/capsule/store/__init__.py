"""capsule.store: a durable, crash-consistent, append-only page store (bytes in, bytes out).

It knows nothing of models: an epoch is an opaque manifest plus a map (region, index) -> page
bytes, written as a delta over the previous epoch. Format and protocol: docs/FORMAT.md.
"""
from .errors import (CapsuleCorrupt, IndexCorrupt, PageCorrupt, SigningKeyError, StoreError, StoreIOError,
                     StoreLocked, UnknownEpoch)
from .info import EpochInfo, VerifyReport
from .segments import FileOps
from .store import Store

__all__ = ["Store", "EpochInfo", "VerifyReport", "FileOps", "StoreError", "CapsuleCorrupt", "StoreLocked",
           "SigningKeyError", "StoreIOError", "UnknownEpoch", "IndexCorrupt", "PageCorrupt"]
