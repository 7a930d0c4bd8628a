"""The fleet layer's typed errors: each says which object or prefix, and what to do."""
from __future__ import annotations

from ..errors import CapsuleError


class FleetError(CapsuleError):
    """Base of the fleet layer's errors (replication, pull, push, fleet memory)."""


class RemoteUnavailable(FleetError):
    """The object store cannot be reached or refused the request (endpoint, credentials, bucket);
    the message gives the S3 error. A replicator retries these by itself."""


class RemoteCorrupt(FleetError):
    """A remote object failed verification (damaged, tampered with, signed with another key, or not
    ours at all). Nothing from it was used."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}; nothing from it was used")
        self.where, self.reason = where, reason


class FleetConflict(FleetError):
    """The prefix belongs to another store, or someone else wrote an epoch there first."""


class FleetKeyError(FleetError):
    """A signed replica read without its fleet key, with another key, or an unsigned one with a key."""
