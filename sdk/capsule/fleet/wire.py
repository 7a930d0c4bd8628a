"""The replica's objects as bytes: a remote epoch (its whole view, where each page lies, and the
caller's manifest), the store card, and their seal. docs/FORMAT.md, "Fleet replicas".

A remote epoch object:

    magic "CPREPL\\x01\\x00" (8) | head_len u32 | head (JSON) | table | app manifest | tag (32)

head: {"store", "epoch", "base", "name", "created", "meta", "signed", "packs": [[key, size], ...],
"regions": [[name, count], ...], "app_bytes"}. table, per region in head order, `count` entries of
"<QQIQI32s": page index (strictly increasing), the epoch that wrote the page, pack number (into
head.packs), offset and length in that pack, and the page's SHA-256. The tag covers everything
before it, after a domain string naming the kind of object ("capsule.fleet epoch\0"):
HMAC-SHA256 under the fleet key for a signed replica, else SHA-256 (damage, not forgery). A page is trusted only when its bytes hash to the table's SHA-256, so the signed epoch
object vouches for every pack byte it uses. Pure functions over untrusted bytes, bounded before
anything is allocated for them (RemoteCorrupt otherwise).
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

from .. import safejson
from .errors import RemoteCorrupt

MAGIC = b"CPREPL\x01\x00"
_HEAD = struct.Struct("<8sI")
ENTRY = struct.Struct("<QQIQI32s")
TAG_BYTES = 32
MAX_OBJECT_BYTES = 64 << 20      # a remote epoch object (its table: ~68 bytes a page)
MAX_HEAD_BYTES = 16 << 20
MAX_HEAD_DEPTH = 8
MAX_PAGE_BYTES = 1 << 30         # as the store's records
MAX_PACK_BYTES = 1 << 31
MAX_INDEX = (1 << 63) - 1
_DOMAIN_EPOCH = b"capsule.fleet epoch\x00"
_DOMAIN_CHECK = b"capsule.fleet key check "


@dataclass(frozen=True)
class PageAt:
    """Where one page of a remote view lies: written by `rec_epoch`, in pack `pack`."""
    rec_epoch: int
    pack: str
    offset: int
    length: int
    sha256: bytes


@dataclass(frozen=True)
class RemoteEpoch:
    store_id: str
    epoch: int
    base: int
    name: str | None
    created: float
    meta: dict[str, Any]
    signed: bool
    view: dict[str, dict[int, PageAt]] = field(hash=False, compare=False)
    app: bytes = b""
    packs: tuple[tuple[str, int], ...] = ()     # (key, size) of every pack the view uses

    def n_pages(self) -> int:
        return sum(len(pages) for pages in self.view.values())

    def page_bytes(self) -> int:
        return sum(p.length for pages in self.view.values() for p in pages.values())


class Seal:
    """The replica's tag: HMAC-SHA256 under a fleet key (>= 16 bytes), or SHA-256 without one."""

    def __init__(self, key: bytes | None):
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ValueError("a fleet sign_key must be bytes, at least 16 of them (e.g. os.urandom(32))")
        self.key = key

    @property
    def signed(self) -> bool:
        return self.key is not None

    def tag(self, data: bytes | memoryview, domain: bytes = _DOMAIN_EPOCH) -> bytes:
        """domain: what kind of object this is, so no object of one kind verifies as another."""
        if self.key is None:
            return hashlib.sha256(domain + bytes(data)).digest()
        return hmac.new(self.key, domain + bytes(data), hashlib.sha256).digest()

    def key_check(self, store_id: str) -> str:
        """What the store card records so a puller with another key is told so up front."""
        if self.key is None:
            return ""
        return hmac.new(self.key, _DOMAIN_CHECK + store_id.encode(), hashlib.sha256).hexdigest()


def encode_epoch(ep: RemoteEpoch, seal: Seal) -> bytes:
    packs = list(ep.packs)
    number = {key: i for i, (key, _) in enumerate(packs)}
    regions = sorted(ep.view)
    head = {"store": ep.store_id, "epoch": ep.epoch, "base": ep.base, "name": ep.name, "created": ep.created,
            "meta": ep.meta, "signed": seal.signed, "packs": [list(p) for p in packs],
            "regions": [[r, len(ep.view[r])] for r in regions], "app_bytes": len(ep.app)}
    head_bytes = safejson.dumps(head)
    parts = [_HEAD.pack(MAGIC, len(head_bytes)), head_bytes]
    for region in regions:
        for index in sorted(ep.view[region]):
            p = ep.view[region][index]
            parts.append(ENTRY.pack(index, p.rec_epoch, number[p.pack], p.offset, p.length, p.sha256))
    parts.append(bytes(ep.app))
    body = b"".join(parts)
    if len(body) + TAG_BYTES > MAX_OBJECT_BYTES:
        raise ValueError(f"epoch {ep.epoch}'s remote object would take {len(body)} bytes; at most "
                         f"{MAX_OBJECT_BYTES} (fewer, larger pages)")
    return body + seal.tag(body)


def decode_epoch(data: bytes, seal: Seal, where: str) -> RemoteEpoch:
    """Verify (tag first, nothing parsed before it) and decode one remote epoch object."""
    if not _HEAD.size + TAG_BYTES <= len(data) <= MAX_OBJECT_BYTES:
        raise RemoteCorrupt(where, f"{len(data)} bytes is not a remote epoch object's size")
    body, tag = memoryview(data)[:-TAG_BYTES], bytes(data[-TAG_BYTES:])
    if not hmac.compare_digest(seal.tag(body), tag):
        raise RemoteCorrupt(where, "its tag does not verify: damaged, or written by someone without this fleet "
                                   "key" if seal.signed else "its SHA-256 does not match: damaged")
    magic, n = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise RemoteCorrupt(where, "not a remote epoch object (bad magic)")
    if n > min(MAX_HEAD_BYTES, len(body) - _HEAD.size):
        raise RemoteCorrupt(where, f"its head claims {n} bytes")
    try:
        head = safejson.loads(body[_HEAD.size:_HEAD.size + n], what="remote epoch head", max_bytes=MAX_HEAD_BYTES,
                              max_depth=MAX_HEAD_DEPTH)
        ep = _parse(head, body[_HEAD.size + n:])
    except (ValueError, TypeError, KeyError, struct.error) as exc:
        raise RemoteCorrupt(where, str(exc)) from None
    if ep.signed != seal.signed:
        raise RemoteCorrupt(where, "it says it is signed but verified without a key" if ep.signed else
                            "it is unsigned but a fleet key was given")
    return ep


def _parse(head: Any, rest: memoryview) -> RemoteEpoch:
    if not isinstance(head, dict):
        raise ValueError("head is not an object")
    epoch, base = _int(head["epoch"], 1, MAX_INDEX, "epoch"), _int(head["base"], 0, MAX_INDEX, "base")
    name, meta, created = head["name"], head["meta"], head["created"]
    if not (name is None or isinstance(name, str)) or not isinstance(meta, dict) \
            or not isinstance(created, (int, float)) or not isinstance(head["store"], str):
        raise ValueError("head fields have the wrong types")
    packs = head["packs"]
    if not isinstance(packs, list):
        raise ValueError("packs is not a list")
    pack_list = []
    for p in packs:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and 0 < len(p[0]) <= 1024):
            raise ValueError("a pack entry is not [key, size]")
        pack_list.append((p[0], _int(p[1], 0, MAX_PACK_BYTES, "pack size")))
    regions, offset = head["regions"], 0
    if not isinstance(regions, list):
        raise ValueError("regions is not a list")
    view: dict[str, dict[int, PageAt]] = {}
    for r in regions:
        if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and r[0] not in view):
            raise ValueError("a region entry is not [unique name, count]")
        count = _int(r[1], 1, (len(rest) - offset) // ENTRY.size, f"region {r[0]!r}'s page count")
        pages, last = {}, -1
        for _ in range(count):
            index, rec_epoch, pack, at, length, sha = ENTRY.unpack_from(rest, offset)
            offset += ENTRY.size
            if index <= last or index > MAX_INDEX or not 1 <= rec_epoch <= epoch or pack >= len(pack_list) \
                    or length > MAX_PAGE_BYTES or at + length > pack_list[pack][1]:
                raise ValueError(f"region {r[0]!r} page {index}: an entry out of bounds")
            pages[index], last = PageAt(rec_epoch, pack_list[pack][0], at, length, sha), index
        view[r[0]] = pages
    app = bytes(rest[offset:])
    if len(app) != _int(head["app_bytes"], 0, MAX_OBJECT_BYTES, "app_bytes"):
        raise ValueError(f"the manifest is {len(app)} bytes, the head says {head['app_bytes']}")
    return RemoteEpoch(head["store"], epoch, base, name, float(created), meta, head["signed"] is True, view, app,
                       tuple(pack_list))


def _int(value: Any, low: int, high: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{what} {value!r} is not an integer in {low}..{high}")
    return value


# -- the store card: which store a prefix replicates (write-once) ---------------------------------
CARD_FORMAT = "capsule-fleet/1"
MAX_CARD_BYTES = 64 << 10


@dataclass(frozen=True)
class StoreCard:
    store_id: str
    signed: bool
    key_check: str      # hex HMAC of the store id under the fleet key ("" unsigned)
    created: float


def encode_card(card: StoreCard) -> bytes:
    return safejson.dumps({"format": CARD_FORMAT, "store": card.store_id, "signed": card.signed,
                           "key_check": card.key_check, "created": card.created})


def decode_card(data: bytes, where: str) -> StoreCard:
    try:
        doc = safejson.loads(data, what="store card", max_bytes=MAX_CARD_BYTES, max_depth=2)
        if not isinstance(doc, dict) or doc.get("format") != CARD_FORMAT:
            raise ValueError(f"not a {CARD_FORMAT} store card")
        store, signed, check, created = doc["store"], doc["signed"], doc["key_check"], doc["created"]
        if not (isinstance(store, str) and isinstance(signed, bool) and isinstance(check, str)
                and isinstance(created, (int, float))):
            raise ValueError("store card fields have the wrong types")
    except (ValueError, KeyError) as exc:
        raise RemoteCorrupt(where, str(exc)) from None
    return StoreCard(store, signed, check, float(created))


def sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()
