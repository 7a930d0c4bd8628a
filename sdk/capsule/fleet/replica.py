"""A replica: one store's epochs under one prefix of an object store, read and written through a Seal.

    PREFIX/store.json                          the store card (write-once): whose epochs these are
    PREFIX/packs/<epoch>-<sha256/16>.pack      page bytes back to back (immutable, content-named)
    PREFIX/epochs/<epoch, 20 digits>.epoch     one remote epoch object (write-once, written last)

An epoch object is uploaded only after every pack it names, so a reader never sees an epoch
whose pages are missing; nothing is ever overwritten. Everything read is verified before use
(wire.py); a key that does not parse as ours is ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

from .bucket import ObjectStore
from .errors import FleetConflict, FleetKeyError, RemoteCorrupt
from .wire import (MAX_CARD_BYTES, MAX_OBJECT_BYTES, RemoteEpoch, Seal, StoreCard, decode_card,
                   decode_epoch, encode_card, sha256)

CARD = "store.json"
EPOCHS = "epochs/"
PACKS = "packs/"
_EPOCH_KEY = re.compile(r"epochs/(\d{20})\.epoch")
_READ_SPAN = 8 << 20      # one ranged GET covers page runs of a pack up to this size

Pages = dict[str, dict[int, bytes]]


def epoch_key(epoch: int) -> str:
    return f"{EPOCHS}{epoch:020d}.epoch"


def pack_key(epoch: int, data: bytes) -> str:
    return f"{PACKS}{epoch:020d}-{sha256(data).hex()[:16]}.pack"


@dataclass(frozen=True)
class RemoteInfo:
    """One remote epoch, as listed (its head read and verified)."""
    epoch: int
    name: str | None
    created: float
    n_pages: int
    page_bytes: int
    meta: dict


class Replica:
    """Reads and writes one prefix. Threading: no state besides the bucket; safe to share."""

    def __init__(self, bucket: ObjectStore, seal: Seal):
        self.bucket, self.seal = bucket, seal
        self.where = bucket.where

    # -- the store card ------------------------------------------------------------------------
    def card(self) -> StoreCard | None:
        data = self.bucket.get(CARD, max_bytes=MAX_CARD_BYTES)
        return None if data is None else decode_card(data, f"{self.where}/{CARD}")

    def claim(self, store_id: str, created: float) -> StoreCard:
        """Make the prefix this store's (first write wins), or check it already is."""
        mine = StoreCard(store_id, self.seal.signed, self.seal.key_check(store_id), created)
        if self.bucket.put(CARD, encode_card(mine), if_absent=True):
            return mine
        card = self.card()
        if card is None:
            raise FleetConflict(f"{self.where}: {CARD} exists but cannot be read back; check the bucket")
        if card.store_id != store_id:
            raise FleetConflict(f"{self.where} replicates store {card.store_id}, not this one ({store_id}): "
                                f"give each store its own prefix (a store pulled from it is a new store)")
        self.check_key(card)
        return card

    def check_key(self, card: StoreCard) -> None:
        """The reader's key must be the one the card was written with (FleetKeyError)."""
        if card.signed and not self.seal.signed:
            raise FleetKeyError(f"{self.where} is signed with a fleet key; give it (sign_key= / --key-file)")
        if not card.signed and self.seal.signed:
            raise FleetKeyError(f"{self.where} is not signed, but a fleet key was given: drop the key, or "
                                f"replicate to a new prefix with it")
        if card.signed and card.key_check != self.seal.key_check(card.store_id):
            raise FleetKeyError(f"{self.where} is signed with another fleet key than the one given")

    # -- epochs --------------------------------------------------------------------------------
    def epoch_ids(self, after: int = 0) -> list[int]:
        """The epochs the prefix holds, oldest first (keys that are not ours are ignored)."""
        start = epoch_key(after) if after else ""
        ids = []
        for key, _ in self.bucket.keys(EPOCHS, start_after=start):
            m = _EPOCH_KEY.fullmatch(key)
            if m and int(m.group(1)) > after:
                ids.append(int(m.group(1)))
        return ids

    def read_epoch(self, epoch: int, store_id: str | None = None) -> RemoteEpoch:
        where = f"{self.where}/{epoch_key(epoch)}"
        data = self.bucket.get(epoch_key(epoch), max_bytes=MAX_OBJECT_BYTES)
        if data is None:
            raise RemoteCorrupt(where, "missing (it was listed)")
        ep = decode_epoch(data, self.seal, where)
        if ep.epoch != epoch:
            raise RemoteCorrupt(where, f"it holds epoch {ep.epoch}")
        if store_id is not None and ep.store_id != store_id:
            raise RemoteCorrupt(where, f"it belongs to store {ep.store_id}, this prefix replicates {store_id}")
        return ep

    def info(self, ep: RemoteEpoch) -> RemoteInfo:
        return RemoteInfo(ep.epoch, ep.name, ep.created, ep.n_pages(), ep.page_bytes(), ep.meta)

    def read_pages(self, ep: RemoteEpoch, progress: Callable[[int, int], None] | None = None) -> Pages:
        """Every page of the epoch's view, each checked against its SHA-256 (RemoteCorrupt)."""
        by_pack: dict[str, list[tuple[str, int]]] = {}
        for region, pages in ep.view.items():
            for index, at in pages.items():
                by_pack.setdefault(at.pack, []).append((region, index))
        total, done = ep.page_bytes(), 0
        out: Pages = {}
        for pack, members in sorted(by_pack.items()):
            members.sort(key=lambda m: ep.view[m[0]][m[1]].offset)
            for run in _spans([(m, ep.view[m[0]][m[1]]) for m in members]):
                start = run[0][1].offset
                end = max(at.offset + at.length for _, at in run)
                blob = self._get_span(pack, start, end - start)
                for (region, index), at in run:
                    page = blob[at.offset - start:at.offset - start + at.length]
                    if sha256(page) != at.sha256:
                        raise RemoteCorrupt(f"{self.where}/{pack}", f"page {region}[{index}] of epoch {ep.epoch} "
                                                                    f"does not match its SHA-256")
                    out.setdefault(region, {})[index] = page
                    done += at.length
                if progress is not None:
                    progress(done, total)
        return out

    def _get_span(self, pack: str, start: int, length: int) -> bytes:
        data = self.bucket.get(pack, max_bytes=max(length, 1), start=start, length=length) if length else b""
        if data is None:
            raise RemoteCorrupt(f"{self.where}/{pack}", "missing: a pack an epoch names is gone")
        return data


def _spans(items: list) -> Iterator[list]:
    """Runs of pages close together in one pack: one ranged GET each."""
    run: list = []
    for item in items:
        at = item[1]
        if run and at.offset + at.length - run[0][1].offset > _READ_SPAN:
            yield run
            run = []
        run.append(item)
    if run:
        yield run

