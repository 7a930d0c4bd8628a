"""One-off transfers: pull a remote epoch into a new local store, push a store's epochs, list a
replica. The CLI's `capsule pull | push | inspect s3://...` call these.

A pulled store is a new store (its own id) holding one epoch: the remote epoch's whole view and
manifest, with its name and metadata (plus "fleet": where it came from). Session.open on it
restores that epoch bit-exactly when the model is the same; the capsule's binding is checked as
for any local epoch, so another model is refused (CapsuleMismatch).
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from ..store import Collection, Store
from .bucket import ObjectStore, S3Bucket
from .errors import FleetConflict, FleetError, RemoteCorrupt
from .records import SDK_COLLECTIONS, list_remote, restore_records, sync_records
from .replica import Replica, RemoteInfo
from .upload import Throttle, attach, upload_epoch
from .wire import RemoteEpoch, Seal

Progress = Callable[[str, int, int], None]   # (what, done, total)


@dataclass(frozen=True)
class Pulled:
    epoch: int           # the remote epoch
    local_epoch: int     # its id in the new store
    pages: int
    page_bytes: int
    seconds: float
    records: int = 0     # keyed records (memory facts, links) copied with it


@dataclass(frozen=True)
class Pushed:
    uploaded: list[int]
    already: int         # epochs the remote held before
    sent_bytes: int
    seconds: float


def open_replica(url: str, sign_key: bytes | None, bucket: ObjectStore | None = None) -> Replica:
    return Replica(bucket if bucket is not None else S3Bucket(url), Seal(sign_key))


def remote_epochs(url: str, *, sign_key: bytes | None = None, bucket: ObjectStore | None = None
                  ) -> tuple[str, list[RemoteInfo | RemoteCorrupt]]:
    """(store id, every remote epoch oldest first: its info, or why it cannot be read)."""
    replica = open_replica(url, sign_key, bucket)
    card = _card(replica, url)
    out: list[RemoteInfo | RemoteCorrupt] = []
    for epoch in replica.epoch_ids():
        try:
            out.append(replica.info(replica.read_epoch(epoch, card.store_id)))
        except RemoteCorrupt as exc:
            out.append(exc)
    return card.store_id, out


def pull(url: str, dest: str | os.PathLike, *, epoch: int | str | None = None, sign_key: bytes | None = None,
         store_key: bytes | None = None, bucket: ObjectStore | None = None,
         progress: Progress | None = None, collections: tuple[Collection, ...] = SDK_COLLECTIONS) -> Pulled:
    """Copy one remote epoch (default: the newest; an id, or a name) into a new store at dest, with
    the replica's keyed records (memory facts) under their ids. The epoch is verified before the
    store is made; dest must hold no epoch and no record (FleetConflict). sign_key: the fleet key
    the replica is signed with; store_key: the new store's own key."""
    began = time.monotonic()
    replica = open_replica(url, sign_key, bucket)
    card = _card(replica, url)
    ep = _pick(replica, card.store_id, epoch, url)
    pages = replica.read_pages(ep, None if progress is None else lambda d, t: progress("pages", d, t))
    meta = {**ep.meta, "fleet": {"from": url, "store": ep.store_id, "epoch": ep.epoch}}
    made = not os.path.lexists(dest)
    try:
        with Store.open(dest, sign_key=store_key) as store:
            if store.latest_epoch() is not None or any(store.count_records(c) for c in collections):
                raise FleetConflict(f"{store.path} already holds epochs or records; pull into a new folder")
            records = restore_records(replica.bucket, replica.seal, store, collections, url)
            items = ((r, i, pages[r][i]) for r in sorted(pages) for i in sorted(pages[r]))
            info = store.write_epoch(items, ep.app, name=ep.name, meta=meta)
    except BaseException:
        if made:     # a store this pull made holds nothing acknowledged: leave no half-pulled folder
            shutil.rmtree(dest, ignore_errors=True)
        raise
    return Pulled(ep.epoch, info.id, ep.n_pages(), ep.page_bytes(), time.monotonic() - began, records)


def push(store_path: str | os.PathLike, url: str, *, sign_key: bytes | None = None, store_key: bytes | None = None,
         bucket: ObjectStore | None = None, max_bytes_per_s: float | None = None,
         progress: Progress | None = None, collections: tuple[Collection, ...] = SDK_COLLECTIONS) -> Pushed:
    """Replicate every retained epoch the remote lacks (a one-off backup; the store must not be open
    elsewhere: StoreLocked)."""
    began = time.monotonic()
    replica = open_replica(url, sign_key, bucket)
    with Store.open(store_path, create=False, sign_key=store_key) as store:
        held, already = attach(replica, store)
        todo = [e for e in store.epochs() if e.id > held.epoch]
        sent = sync_records(store, replica.bucket, replica.seal, collections, list_remote(replica.bucket))
        throttle, done = Throttle(max_bytes_per_s), []
        for n, info in enumerate(todo):
            got = upload_epoch(store, replica, info, held, throttle)
            sent += got.sent_bytes
            done.append(info.id)
            if progress is not None:
                progress("epochs", n + 1, len(todo))
    return Pushed(done, already, sent, time.monotonic() - began)


def _card(replica: Replica, url: str):
    card = replica.card()
    if card is None:
        raise FleetError(f"{url} holds no replica (no store.json): check the URL, or push a store there first")
    replica.check_key(card)
    return card


def _pick(replica: Replica, store_id: str, epoch: int | str | None, url: str) -> RemoteEpoch:
    ids = replica.epoch_ids()
    if not ids:
        raise FleetError(f"{url} holds no epoch yet")
    if epoch is None:
        return replica.read_epoch(ids[-1], store_id)
    if isinstance(epoch, int) or (isinstance(epoch, str) and epoch.isdigit()):
        wanted = int(epoch)
        if wanted not in ids:
            raise FleetError(f"{url} holds no epoch {wanted}; it holds {_shown(ids)}")
        return replica.read_epoch(wanted, store_id)
    for e in reversed(ids):   # a name: the newest epoch carrying it
        ep = replica.read_epoch(e, store_id)
        if ep.name == epoch:
            return ep
    raise FleetError(f"{url} holds no epoch named {epoch!r}")


def _shown(ids: list[int]) -> str:
    return ", ".join(map(str, ids if len(ids) <= 6 else ids[:3] + ["..."] + ids[-3:]))  # type: ignore[operator]
