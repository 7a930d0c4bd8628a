"""A replica's keyed records: what a store keeps outside its epochs (memory facts, their fleet
links), copied so that a pulled store holds them under the same ids. A capsule names the facts
injected into its streams by id; restored without them, those facts would be dropped.

    PREFIX/records/<collection>/<id, 20 digits>-<version, 20 digits>.rec   write-once: row + blob
    PREFIX/records/<collection>/<id, 20 digits>.forget                      write-once: forgotten

Records are synced before the epochs committed after them are uploaded (Replicator), so a remote
epoch never names a fact the replica lacks. A pull takes each record's newest version unless it
was forgotten. Objects are sealed (sealed.py) and bound to their key: collection, id and version
in the head must be the key's.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from ..memory.factrows import FACTS
from ..store import Collection, RecordCorrupt, RecordRowCorrupt, Store, UnknownRecord
from .bucket import ObjectStore
from .errors import RemoteCorrupt
from .memory_sync import LINKS
from .sealed import MAX_HEAD_BYTES, open_object, seal_object
from .wire import Seal

log = logging.getLogger("capsule")
SDK_COLLECTIONS: tuple[Collection, ...] = (FACTS, LINKS)
_KEY = re.compile(r"records/([A-Za-z_][A-Za-z0-9_]{0,63})/(\d{20})(?:-(\d{20})\.rec|\.forget)")
_MAGIC, _FORGET = b"CPRECORD", b"CPRECFRG"
_DOMAIN, _FORGET_DOMAIN = b"capsule.fleet record\x00", b"capsule.fleet record forget\x00"
MAX_BLOB = 1 << 30
Key = tuple[str, int]


@dataclass
class RemoteRecords:
    """What the replica holds: the newest version of each record, and the forgotten ones."""
    versions: dict[Key, int] = field(default_factory=dict)
    forgotten: set[Key] = field(default_factory=set)


def rec_key(coll: str, rid: int, version: int) -> str:
    return f"records/{coll}/{rid:020d}-{version:020d}.rec"


def forget_key(coll: str, rid: int) -> str:
    return f"records/{coll}/{rid:020d}.forget"


def list_remote(bucket: ObjectStore) -> RemoteRecords:
    out = RemoteRecords()
    for key, _ in bucket.keys("records/"):
        m = _KEY.fullmatch(key)
        if not m:
            continue
        k = (m.group(1), int(m.group(2)))
        if m.group(3) is None:
            out.forgotten.add(k)
        else:
            out.versions[k] = max(out.versions.get(k, 0), int(m.group(3)))
    return out


def sync_records(store: Store, bucket: ObjectStore, seal: Seal, collections: tuple[Collection, ...],
                 remote: RemoteRecords) -> int:
    """Upload the records (and forgets) of `collections` the replica lacks; returns bytes sent.
    A record damaged here is skipped with a warning (the replica keeps its older version)."""
    sent = 0
    for coll in collections:
        rows = store.records(coll)
        here = {r.id for r in rows}
        for r in rows:
            k = (coll.name, r.id)
            if r.row is None or remote.versions.get(k, 0) >= r.version:
                continue
            try:
                rec = store.record(coll, r.id)
            except UnknownRecord:
                continue                                  # forgotten meanwhile: the next sync says so
            except (RecordCorrupt, RecordRowCorrupt) as exc:
                log.warning("replication skips %s %d: %s", coll.name, r.id, exc)
                continue
            data = seal_object(_MAGIC, _DOMAIN, {"collection": coll.name, "id": rec.id, "version": rec.version,
                                                 "row": rec.row}, rec.blob, seal)
            bucket.put(rec_key(coll.name, rec.id, rec.version), data, if_absent=True)
            remote.versions[k] = rec.version
            sent += len(data)
        for k in sorted(remote.versions):
            if k[0] == coll.name and k[1] not in here and k not in remote.forgotten:
                data = seal_object(_FORGET, _FORGET_DOMAIN, {"collection": k[0], "id": k[1]}, b"", seal)
                bucket.put(forget_key(*k), data, if_absent=True)
                remote.forgotten.add(k)
                sent += len(data)
    return sent


def restore_records(bucket: ObjectStore, seal: Seal, store: Store, collections: tuple[Collection, ...],
                    where: str) -> int:
    """Copy every record the replica holds (newest version, not forgotten) into `store` under its
    id. Everything is fetched and verified before the first is written; returns how many."""
    remote = list_remote(bucket)
    by_name = {c.name: c for c in collections}
    todo = []
    for (coll, rid), version in sorted(remote.versions.items()):
        if coll not in by_name or (coll, rid) in remote.forgotten:
            continue
        key = rec_key(coll, rid, version)
        data = bucket.get(key, max_bytes=MAX_HEAD_BYTES + MAX_BLOB + 64)
        if data is None:
            raise RemoteCorrupt(f"{where}/{key}", "listed, then missing")
        head, blob = open_object(data, _MAGIC, _DOMAIN, seal, f"{where}/{key}", MAX_BLOB)
        if (head.get("collection"), head.get("id"), head.get("version")) != (coll, rid, version) \
                or not isinstance(head.get("row"), dict):
            raise RemoteCorrupt(f"{where}/{key}", "its head is not the record its name says")
        todo.append((by_name[coll], rid, head["row"], blob))
    for coll, rid, row, blob in todo:
        try:
            store.put_record(coll, row, blob, record_id=rid)
        except ValueError as exc:
            raise RemoteCorrupt(f"{where}/{rec_key(coll.name, rid, remote.versions[(coll.name, rid)])}",
                                str(exc)) from None
    return len(todo)
