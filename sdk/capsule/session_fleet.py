"""The Session's fleet half: building its replicator and running a fleet-memory sync. The fleet
layer (and boto3 under it) is imported only here, and only for a Session that uses it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping

from .store import Store

if TYPE_CHECKING:
    from .fleet import Replication, Replicator
    from .fleet.memory_sync import MemoryHost, MemorySync


def replication_of(value: "str | Replication | Mapping[str, Any]") -> "Replication":
    """Session.open's replicate=, checked before anything is opened (ValueError saying what)."""
    from .fleet import Replication

    return Replication.of(value)


def start_replicator(store: Store, replication: "Replication") -> "Replicator":
    from .fleet import Replicator
    from .fleet.records import SDK_COLLECTIONS   # memory facts (and their fleet links) go along

    return Replicator(store, replication, collections=SDK_COLLECTIONS).start()


def sync_memory(url: str, sign_key: bytes | None, section: Callable[[], ContextManager["MemoryHost"]]) -> "MemorySync":
    from .fleet.memory_sync import FleetMemory, sync

    return sync(FleetMemory(url, sign_key), section)
