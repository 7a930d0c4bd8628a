"""Fleet memory: robots publish their facts to one shared prefix and merge the others'.

    MEM/facts/<h>.fact          a fact (text, tags, created, embedding), write-once
    MEM/kv/<h>/<model>.kv       its pre-RoPE K/V under one model (fingerprint + rope), write-once
    MEM/forgets/<h>.forget      a tombstone, write-once

h is the fact's content hash (factwire.content_hash): two robots remembering the same text and tags
publish one fact. The rule for forget is **forget wins, for good**: once any robot forgets a fact
it had shared (or merged), a tombstone is published; every robot forgets its copies at its next
sync and never merges that content again. Teaching it again takes other words or tags.

A robot keeps which of its facts are linked to which fleet fact in its own store (collection
"fleet_fact": hash, fact id, memory URL), so a local forget is noticed, and tombstoned, at the
next sync even when it happened offline. A sync is three steps, and only the first and last hold
the Session's LLM lock: snapshot the local facts, exchange with the object store (no lock), apply.

Threading: a FleetMemory is used by one sync at a time (the Session serializes them).
"""
from __future__ import annotations

import re
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol

from ..errors import CapsuleError
from ..memory.facterrors import DamagedFactWarning, UnknownFact
from ..memory.facts import Memory
from ..store import Collection, UnknownRecord
from .bucket import ObjectStore, S3Bucket
from .errors import RemoteCorrupt
from .factwire import (MAX_EMBEDDING_BYTES, MAX_KV_BYTES, FleetFact, FleetKV, content_hash,
                       decode_fact, decode_forget, decode_kv, encode_fact, encode_forget, encode_kv, model_key)
from .sealed import MAX_HEAD_BYTES
from .wire import Seal

LINKS = Collection("fleet_fact", (("hash", "text"), ("fact", "int"), ("memory", "text")))
_FACT = re.compile(r"facts/([0-9a-f]{64})\.fact")
_KV = re.compile(r"kv/([0-9a-f]{64})/([0-9a-f]{32})\.kv")
_FORGET = re.compile(r"forgets/([0-9a-f]{64})\.forget")


@dataclass(frozen=True)
class MemorySync:
    """What one sync did: facts published / merged here (reencoded: merged without K/V for this
    model, encoded here), K/V shared for facts others published, local facts forgotten by a fleet
    tombstone, tombstones published for facts forgotten here, and objects refused (with why)."""
    published: int = 0
    merged: int = 0
    reencoded: int = 0
    kv_shared: int = 0
    forgotten: int = 0
    tombstoned: int = 0
    refused: tuple[str, ...] = ()
    seconds: float = 0.0


@dataclass
class _Remote:
    facts: set[str] = field(default_factory=set)
    kv: set[tuple[str, str]] = field(default_factory=set)
    forgets: set[str] = field(default_factory=set)


@dataclass
class _Local:
    hashes: dict[int, str]                 # local fact id -> content hash (sound facts)
    texts: dict[int, tuple[str, tuple[str, ...], float, int]]   # text, tags, created, n_tokens
    ours: set[int]                         # facts whose K/V is under this model
    links: dict[int, tuple[int, str]]      # link record id -> (fact id, hash), for this memory URL
    model: str                             # model_key of this Session's memory


class FleetMemory:
    def __init__(self, url: str, sign_key: bytes | None = None, bucket: ObjectStore | None = None):
        self.url, self.seal = url, Seal(sign_key)
        self.bucket = bucket if bucket is not None else S3Bucket(url)
        self.by = socket.gethostname()[:64]

    # -- 1. snapshot (under the LLM lock) ------------------------------------------------------
    def snapshot(self, memory: Memory) -> _Local:
        table = memory.store
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DamagedFactWarning)   # a damaged fact is not shared
            infos = table.facts()
        hashes = {f.id: content_hash(f.text, f.tags) for f in infos}
        texts = {f.id: (f.text, f.tags, f.created, f.n_tokens) for f in infos}
        ours = {f.id for f in infos if (f.fingerprint, f.rope) == (memory.fingerprint, memory.rope)}
        links = {}
        for row in table.store.records(LINKS):
            if row.row is not None and row.row["memory"] == self.url:
                links[row.id] = (row.row["fact"], row.row["hash"])
        return _Local(hashes, texts, ours, links, model_key(memory.fingerprint, memory.rope))

    # -- 2. exchange (no lock) -----------------------------------------------------------------
    def remote(self) -> _Remote:
        r = _Remote()
        for key, _ in self.bucket.keys(""):
            if m := _FACT.fullmatch(key):
                r.facts.add(m.group(1))
            elif m := _KV.fullmatch(key):
                r.kv.add((m.group(1), m.group(2)))
            elif m := _FORGET.fullmatch(key):
                r.forgets.add(m.group(1))
        return r

    def forgets_verified(self, hashes: set[str]) -> tuple[set[str], list[str]]:
        """The tombstones among `hashes` that verify (a forged one is refused, not obeyed)."""
        good, refused = set(), []
        for h in sorted(hashes):
            try:
                data = self.bucket.get(f"forgets/{h}.forget", max_bytes=MAX_HEAD_BYTES + 64)
                if data is not None:
                    decode_forget(data, self.seal, f"{self.url}/forgets/{h}.forget", h)
                    good.add(h)
            except RemoteCorrupt as exc:
                refused.append(str(exc))
        return good, refused

    def fetch(self, h: str, model: str, fingerprint: str, rope: str, with_kv: bool
              ) -> tuple[FleetFact, FleetKV | None]:
        where = f"{self.url}/facts/{h}.fact"
        data = self.bucket.get(f"facts/{h}.fact", max_bytes=MAX_HEAD_BYTES + MAX_EMBEDDING_BYTES + 64)
        if data is None:
            raise RemoteCorrupt(where, "listed, then missing")
        fact = decode_fact(data, self.seal, where, h)
        kv = None
        if with_kv:
            kwhere = f"{self.url}/kv/{h}/{model}.kv"
            kdata = self.bucket.get(f"kv/{h}/{model}.kv", max_bytes=MAX_HEAD_BYTES + MAX_KV_BYTES + 64)
            kv = None if kdata is None else decode_kv(kdata, self.seal, kwhere, h, fingerprint, rope)
        return fact, kv

    def publish(self, fact: FleetFact | None, kv: FleetKV | None, model: str) -> None:
        """K/V first, the fact last (None: only K/V for a fact already there): a listed fact's K/V
        is either there whole or absent."""
        if kv is not None:
            self.bucket.put(f"kv/{kv.hash}/{model}.kv", encode_kv(kv, self.seal), if_absent=True)
        if fact is not None:
            self.bucket.put(f"facts/{fact.hash}.fact", encode_fact(fact, self.seal), if_absent=True)

    def tombstone(self, h: str) -> None:
        self.bucket.put(f"forgets/{h}.forget", encode_forget(h, time.time(), self.by, self.seal), if_absent=True)


class MemoryHost(Protocol):
    """What a sync needs of a Session's memory part (session_memory.MemoryPart)."""
    memory: Memory

    def forget(self, fact_id: int) -> None: ...


def sync(fm: FleetMemory, section: Callable[[], ContextManager[MemoryHost]]) -> MemorySync:
    """One sync: snapshot and read what to publish under `section()` (the LLM lock), exchange with
    no lock held, then apply under it again. RemoteUnavailable when the store cannot be reached
    (what was already published stays: every object is write-once and the next sync goes on)."""
    began = time.monotonic()
    remote = fm.remote()
    # tombstones are obeyed only when they verify (a fact object is never deleted, so a fact
    # forgotten by the fleet is always listed among the facts too)
    forgets, refused = fm.forgets_verified(remote.forgets & remote.facts)
    with section() as host:
        mem = host.memory
        local = fm.snapshot(mem)
        here = set(local.hashes.values())
        fingerprint, rope = mem.fingerprint, mem.rope
        publish = {h: fid for fid, h in sorted(local.hashes.items()) if h not in remote.facts | forgets}
        share = {h: fid for fid, h in sorted(local.hashes.items())
                 if h in remote.facts and (h, local.model) not in remote.kv and fid in local.ours}
        embeddings = {i: (name, blob) for i, name, blob in mem.store.fact_embeddings()} if publish else {}
        outgoing = {h: _outgoing(mem, local, fid, h, embeddings.get(fid) if h in publish else False)
                    for h, fid in {**publish, **share}.items()}
    gone = {lid: h for lid, (fid, h) in local.links.items() if fid not in local.hashes}
    tombstones = set(gone.values()) - here - forgets
    for h in sorted(tombstones):
        fm.tombstone(h)
    for h in sorted(outgoing):
        fm.publish(*outgoing[h], local.model)
    incoming = []
    for h in sorted(remote.facts - here - forgets - tombstones):   # not what we just forgot
        try:
            incoming.append(fm.fetch(h, local.model, fingerprint, rope, (h, local.model) in remote.kv))
        except RemoteCorrupt as exc:
            refused.append(str(exc))
    with section() as host:
        mem = host.memory
        for lid in gone:
            _unlink(mem, lid)
        forgotten = 0
        for fid, h in local.hashes.items():
            if h in forgets:
                forgotten += _forget(host, fid)
                for lid, (lfid, _) in local.links.items():
                    if lfid == fid:
                        _unlink(mem, lid)
        linked = {fid for fid, _ in local.links.values()}
        for fid, h in local.hashes.items():     # every local copy of a shared fact: its forget is noticed
            if fid not in linked and h not in forgets and (h in publish or h in remote.facts):
                _link(mem, fm.url, h, fid)
        reencoded = 0
        for fact, kv in incoming:
            emb = (fact.embedder, fact.embedding) if fact.embedder else None
            fid = mem.adopt(fact.text, fact.tags, None if kv is None else kv.kv, emb)
            reencoded += kv is None
            _link(mem, fm.url, fact.hash, fid)
    return MemorySync(len(publish), len(incoming), reencoded, len(share), forgotten,
                      len(tombstones), tuple(refused), time.monotonic() - began)


def _outgoing(mem: Memory, local: _Local, fid: int, h: str, emb: tuple[str, bytes] | None | bool
              ) -> tuple[FleetFact | None, FleetKV | None]:
    """What to upload for a local fact: the fact itself with its embedding (emb False: not the fact,
    only K/V) and its K/V when it is under this model."""
    kv = None
    if fid in local.ours:
        try:
            kv = FleetKV(h, mem.fingerprint, mem.rope, local.texts[fid][3], bytes(mem.store.fact_kv(fid)))
        except CapsuleError:
            kv = None                      # damaged here: the fact goes without K/V
    if emb is False:
        return None, kv
    text, tags, created, _ = local.texts[fid]
    fact = FleetFact(h, text, tags, created, emb[0] if emb else None, emb[1] if emb else b"")
    return fact, kv


def _link(memory: Memory, url: str, h: str, fact_id: int) -> None:
    memory.store.store.put_record(LINKS, {"hash": h, "fact": fact_id, "memory": url}, b"")


def _unlink(memory: Memory, link_id: int) -> None:
    try:
        memory.store.store.forget_record(LINKS, link_id)
    except UnknownRecord:
        pass


def _forget(host: MemoryHost, fact_id: int) -> int:
    try:
        host.forget(fact_id)
        return 1
    except UnknownFact:
        return 0
