"""capsule.store: a durable, crash-consistent, append-only page store (bytes in, bytes out).

It knows nothing of models: an epoch is an opaque manifest plus a map (region, index) -> page
bytes, written as a delta over the previous epoch; a fact is text, tags and an opaque KV blob.
Format and protocol: docs/FORMAT.md.
"""
from .errors import (CapsuleCorrupt, DamagedFactWarning, FactCorrupt, FactRowCorrupt, IndexCorrupt,
                     PageCorrupt, SigningKeyError, StoreError, StoreIOError, StoreLocked, UnknownEpoch,
                     UnknownFact, UnsafeStore)
from .info import EpochInfo, FactInfo, VerifyReport
from .segments import FileOps
from .store import Store

__all__ = ["Store", "EpochInfo", "FactInfo", "VerifyReport", "FileOps", "StoreError", "CapsuleCorrupt",
           "StoreLocked", "SigningKeyError", "StoreIOError", "UnsafeStore", "UnknownEpoch", "UnknownFact",
           "IndexCorrupt", "PageCorrupt", "FactCorrupt", "FactRowCorrupt", "DamagedFactWarning"]
