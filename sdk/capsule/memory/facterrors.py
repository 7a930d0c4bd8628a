"""Errors and warnings about memory facts: the store's keyed-record errors, said of facts."""
from __future__ import annotations

from ..store.errors import CapsuleCorrupt, RecordCorrupt, RecordRowCorrupt, UnknownRecord


class UnknownFact(UnknownRecord):
    """A fact id the store does not hold (never added, or forgotten: ids are never reused)."""


class FactCorrupt(RecordCorrupt):
    """A fact's KV record failed verification: region is "fact", index the fact id, epoch 0 (facts
    belong to no epoch); `version` is the KV version the index expects."""

    def __init__(self, fact_id: int, version: int, segment: int, offset: int, reason: str):
        super().__init__("fact", fact_id, version, segment, offset, reason)
        CapsuleCorrupt.__init__(self, f"{self.summary}. Other facts and every epoch are unaffected; re-encode "
                                      f"it (`capsule memory reencode`) or forget it; `capsule verify` lists all damage")

    @property
    def fact_id(self) -> int:
        return self.index  # type: ignore[return-value]

    @property
    def summary(self) -> str:
        return (f"fact {self.index}: its KV record (version {self.version}, segment {self.segment:06d}, "
                f"offset {self.offset}) is corrupt: {self.reason}")

    def __reduce__(self):
        return (FactCorrupt, (self.index, self.version, self.segment, self.offset, self.reason))


class FactRowCorrupt(RecordRowCorrupt):
    """A fact's index row is damaged: a field fails the checks add_fact makes, or its text is not
    the text its KV record was encoded from. `fact_id` and `reason` say which and why."""

    def __init__(self, fact_id: int, reason: str):
        self.collection, self.record_id, self.fact_id, self.reason = "fact", fact_id, fact_id, reason
        CapsuleCorrupt.__init__(self, f"fact {fact_id}: its index row is damaged: {reason}. Other facts and every "
                                      f"epoch are unaffected; forget it (Session.forget) and remember it again; "
                                      f"`capsule verify` lists all damage")

    def __reduce__(self):
        return (FactRowCorrupt, (self.fact_id, self.reason))


class DamagedFactWarning(UserWarning):
    """A damaged fact was left out of a listing (facts, fact_embeddings, search)."""
