"""Uploading one committed epoch: the pages the remote does not hold yet, packed; then the epoch
object naming where every page of its view lies. Used by the background replicator and by
`capsule push`.

What the remote holds is known from the newest epoch it has (its view: identity (region, index,
writing epoch) -> where the page lies). A page found there is not sent again; anything else is
(after a rollback, a retention gap or a damaged newest epoch that costs bytes, never
correctness: every epoch object names pages that are already uploaded).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ..store import EpochInfo, Store
from .errors import FleetConflict, RemoteCorrupt
from .replica import Replica, epoch_key, pack_key
from .wire import PageAt, RemoteEpoch, encode_epoch, sha256

log = logging.getLogger("capsule")
PACK_BYTES = 8 << 20     # a pack is cut at about this size (one PUT each: bounded latency, fine throttling)
Identity = tuple[str, int, int]   # (region, index, epoch that wrote the page)


@dataclass
class Held:
    """Pages the remote holds, as the newest remote epoch's view says (None: nothing known yet)."""
    epoch: int = 0
    pages: dict[Identity, PageAt] = field(default_factory=dict)
    packs: dict[str, int] = field(default_factory=dict)    # key -> size, of the packs those pages lie in

    @classmethod
    def of(cls, ep: RemoteEpoch) -> "Held":
        sizes = dict(ep.packs)
        pages = {(r, i, at.rec_epoch): at for r, pp in ep.view.items() for i, at in pp.items()}
        return cls(ep.epoch, pages, {at.pack: sizes[at.pack] for at in pages.values()})


class Throttle:
    """At most `rate` bytes a second on average (None: no limit); waits end early on `stop`."""

    def __init__(self, rate: float | None, stop: threading.Event | None = None):
        if rate is not None and rate <= 0:
            raise ValueError(f"max_bytes_per_s must be > 0 (or None), got {rate}")
        self.rate, self.stop = rate, stop or threading.Event()
        self._free_at = time.monotonic()

    def spend(self, nbytes: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + nbytes / self.rate
        if self._free_at > now:
            self.stop.wait(self._free_at - now)


@dataclass(frozen=True)
class Uploaded:
    epoch: int
    sent_bytes: int       # pack bytes sent (pages the remote lacked) plus the epoch object
    pages_sent: int
    already: bool = False  # the remote held this very epoch (our own earlier upload)


def attach(replica: Replica, store: Store) -> tuple[Held, int]:
    """Claim the prefix for this store (or check it is its own), then learn what the remote holds:
    (the newest remote epoch's view, how many epochs it holds). A newest epoch that cannot be used
    costs a whole upload of the next one, nothing else."""
    replica.claim(store.store_id, time.time())
    ids = replica.epoch_ids()
    if not ids:
        return Held(), 0
    try:
        return Held.of(replica.read_epoch(ids[-1], store.store_id)), len(ids)
    except RemoteCorrupt as exc:
        log.warning("%s: the newest remote epoch cannot be used (%s); the next epoch is sent whole", replica.where, exc)
        return Held(epoch=ids[-1]), len(ids)


def upload_epoch(store: Store, replica: Replica, info: EpochInfo, held: Held, throttle: Throttle) -> Uploaded:
    """Replicate one committed epoch; `held` becomes its view. Raises UnknownEpoch if retention
    dropped it meanwhile, PageCorrupt if a local record is damaged, RemoteUnavailable on the
    network, FleetConflict if another store wrote this epoch number first."""
    epoch = info.id
    view = store.view(epoch)
    missing = sorted((r, i, e) for r, pages in view.items() for i, e in pages.items() if (r, i, e) not in held.pages)
    placed: dict[Identity, PageAt] = {}
    sizes: dict[str, int] = {}
    sent = 0
    app, pages = store.load_epoch(epoch, only=[(r, i) for r, i, _ in missing])   # the manifest, and what is missing
    if missing:
        for batch in _batches(missing, pages):
            data = b"".join(bytes(pages[r][i]) for r, i, _ in batch)
            key = pack_key(epoch, data)
            replica.bucket.put(key, data, if_absent=True)   # False: the same bytes are there already
            throttle.spend(len(data))
            sent += len(data)
            sizes[key] = len(data)
            at = 0
            for r, i, e in batch:
                page = pages[r][i]
                placed[(r, i, e)] = PageAt(e, key, at, len(page), sha256(page))
                at += len(page)
    where = {**held.pages, **placed}
    remote_view = {r: {i: where[(r, i, e)] for i, e in pages.items()} for r, pages in view.items()}
    used = sorted({at.pack for pp in remote_view.values() for at in pp.values()})
    all_sizes = {**held.packs, **sizes}
    ep = RemoteEpoch(store.store_id, epoch, info.base, info.name, info.created, dict(info.meta),
                     replica.seal.signed, remote_view, bytes(app), tuple((k, all_sizes[k]) for k in used))
    data = encode_epoch(ep, replica.seal)
    already = not replica.bucket.put(epoch_key(epoch), data, if_absent=True)
    sent += 0 if already else len(data)
    if already:
        _check_same(replica, ep)
    new = Held.of(ep)
    held.epoch, held.pages, held.packs = new.epoch, new.pages, new.packs
    return Uploaded(epoch, sent, len(missing), already)


def _batches(missing: list[Identity], pages: dict) -> list[list[Identity]]:
    out: list[list[Identity]] = [[]]
    size = 0
    for r, i, e in missing:
        n = len(pages[r][i])
        if out[-1] and size + n > PACK_BYTES:
            out.append([])
            size = 0
        out[-1].append((r, i, e))
        size += n
    return [b for b in out if b]


def _check_same(replica: Replica, ep: RemoteEpoch) -> None:
    """The epoch object existed: fine if it is this store's same epoch (an upload whose answer was
    lost), a conflict otherwise."""
    try:
        there = replica.read_epoch(ep.epoch)
    except RemoteCorrupt as exc:
        raise FleetConflict(f"{replica.where} already holds an epoch {ep.epoch} that does not verify "
                            f"({exc.reason}); replicate to a new prefix") from None
    same_view = {r: {i: a.rec_epoch for i, a in p.items()} for r, p in there.view.items()} == \
                {r: {i: a.rec_epoch for i, a in p.items()} for r, p in ep.view.items()}
    if there.store_id != ep.store_id or not same_view or there.app != ep.app:
        raise FleetConflict(f"{replica.where} already holds another epoch {ep.epoch} (store {there.store_id}); "
                            f"another writer shares this prefix: give each store its own")
