"""Replication settings: a frozen dataclass that checks itself (ValueError says what to change)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .bucket import parse_url


@dataclass(frozen=True)
class Replication:
    """Where and how a Session's committed epochs are copied, in the background.

    url: s3://bucket/prefix, one prefix per store (endpoint and credentials: the AWS variables).
    sign_key: the fleet key (>= 16 bytes): every epoch object is HMAC-signed with it and a puller
        needs it; None: SHA-256 only (catches damage, not forgery).
    max_queue: at most this many committed epochs wait; when the replicator falls further behind
        (an outage), the oldest waiting ones are skipped: the newest always goes. Local retention
        (keep_epochs) drops epochs too: keep it >= max_queue for the queue to be what bounds.
    max_bytes_per_s: upload bandwidth cap (None: none).
    close_timeout_s: Session.close waits at most this long for the remote to catch up, then warns.
    retry_s: first wait after a failed upload (doubling up to retry_max_s: the longest a server
        that came back waits for the next try).
    """
    url: str
    sign_key: bytes | None = None
    max_queue: int = 64
    max_bytes_per_s: float | None = None
    close_timeout_s: float = 10.0
    retry_s: float = 0.5
    retry_max_s: float = 5.0

    def __post_init__(self) -> None:
        parse_url(self.url)
        if self.sign_key is not None and (not isinstance(self.sign_key, bytes) or len(self.sign_key) < 16):
            raise ValueError("Replication.sign_key must be bytes, at least 16 of them (e.g. os.urandom(32))")
        if not isinstance(self.max_queue, int) or isinstance(self.max_queue, bool) or self.max_queue < 1:
            raise ValueError(f"Replication.max_queue must be an int >= 1, got {self.max_queue!r}")
        if self.max_bytes_per_s is not None and not (isinstance(self.max_bytes_per_s, (int, float))
                                                     and math.isfinite(self.max_bytes_per_s)
                                                     and self.max_bytes_per_s > 0):
            raise ValueError(f"Replication.max_bytes_per_s must be > 0 bytes/s or None, got {self.max_bytes_per_s!r}")
        for name in ("close_timeout_s", "retry_s", "retry_max_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Replication.{name} must be a finite number >= 0, got {value!r}")
        if self.retry_max_s < self.retry_s:
            raise ValueError("Replication.retry_max_s must be >= retry_s")

    @classmethod
    def of(cls, value: "str | Replication | Mapping[str, Any]") -> "Replication":
        """Session.open's replicate=: a URL, a Replication, or a dict of its fields."""
        if isinstance(value, Replication):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"replicate: unknown field(s) {', '.join(sorted(unknown))}; "
                                 f"known: {', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ValueError(f"replicate must be 's3://bucket/prefix', a Replication or a dict, got {type(value).__name__}")

    def __repr__(self) -> str:   # never print the key
        return (f"Replication(url={self.url!r}, signed={self.sign_key is not None}, max_queue={self.max_queue}, "
                f"max_bytes_per_s={self.max_bytes_per_s}, close_timeout_s={self.close_timeout_s})")
