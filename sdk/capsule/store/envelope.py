"""The epoch envelope: what a KIND_EPOCH record holds, so the log alone says what an epoch is.

payload = magic (8) | head length (u32) | head (JSON) | listing | the caller's manifest bytes

head: {"store": store id, "epoch", "base", "name", "created", "meta", "page_bytes", "n_pages",
"regions": [[name, count], ...]}. listing, per region in head order: count u64 page indexes
(strictly increasing), count u64 record epochs, count record tags. Together they name every page
record the epoch's view uses, by identity (region, index, epoch that wrote it) and tag (the
record's xxh3 / HMAC). The tag of the envelope's own record covers all of it: an index row that
points at another record, or a record from another store, can never pass for one listed here,
and a signed store's listing cannot be changed without the key. Pure functions over bytes; what
is decoded is untrusted and bounded before anything is allocated for it (RecordError otherwise).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from .. import safejson
from .records import JSON_HEAD, MAX_EPOCH, MAX_NAME_BYTES, MAX_PAGE_INDEX, Buffer, RecordError, read_json_head

MAGIC = b"CPEPOCH\x01"
_HEAD = JSON_HEAD
MAX_HEAD_BYTES = 16 << 20
# (region, index) -> (epoch of the record, its tag), held per region: a delta touches few regions
Listing = dict[str, dict[int, tuple[int, bytes]]]


@dataclass(frozen=True)
class Envelope:
    store_id: str
    epoch: int
    base: int
    name: str | None
    created: float
    meta: dict[str, Any]
    page_bytes: int             # bytes of the page records this epoch wrote
    n_pages: int                # how many it wrote (listing entries whose epoch is this one)
    listing: Listing = field(hash=False, compare=False)
    app: bytes = b""            # the caller's manifest
    # the epochs the store retained when this one was written, itself included, as inclusive
    # [first, last] runs (None: not recorded): a rebuild does not bring back epochs dropped before
    retained: tuple[tuple[int, int], ...] | None = None

    def entries(self) -> int:
        return sum(len(pages) for pages in self.listing.values())


# region -> (its page dict, that dict's encoded listing): a delta shares the dicts of the regions
# it did not write with the previous listing, so only the written regions are encoded again
EncodeCache = dict[str, tuple[dict[int, tuple[int, bytes]], bytes]]


def encode(env: Envelope, tag_bytes: int, cache: EncodeCache | None = None) -> bytes:
    regions = sorted(env.listing)
    head = {"store": env.store_id, "epoch": env.epoch, "base": env.base, "name": env.name,
            "created": env.created, "meta": env.meta, "page_bytes": env.page_bytes, "n_pages": env.n_pages,
            "regions": [[r, len(env.listing[r])] for r in regions]}
    if env.retained is not None:
        head["retained"] = [list(run) for run in env.retained]
    head_bytes = safejson.dumps(head)
    parts = [_HEAD.pack(MAGIC, len(head_bytes)), head_bytes]
    for region in regions:
        pages = env.listing[region]
        hit = cache.get(region) if cache is not None else None
        if hit is not None and hit[0] is pages:
            parts.append(hit[1])
            continue
        encoded = _encode_region(pages, tag_bytes)
        if cache is not None:
            cache[region] = (pages, encoded)
        parts.append(encoded)
    if cache is not None:
        for gone in cache.keys() - env.listing.keys():
            del cache[gone]
    parts.append(bytes(env.app))
    return b"".join(parts)


def _encode_region(pages: dict[int, tuple[int, bytes]], tag_bytes: int) -> bytes:
    idxs = sorted(pages)
    tags = b"".join(pages[i][1] for i in idxs)
    if len(tags) != tag_bytes * len(idxs):
        raise ValueError("a listed tag has the wrong length")
    return b"".join((struct.pack(f"<{len(idxs)}Q", *idxs), struct.pack(f"<{len(idxs)}Q", *(pages[i][0] for i in idxs)),
                     tags))


def is_envelope(payload: Buffer) -> bool:
    return len(payload) >= _HEAD.size and bytes(payload[:8]) == MAGIC


def decode(payload: Buffer, tag_bytes: int) -> Envelope:
    """Parse and bound-check an envelope (RecordError on anything off)."""
    view = memoryview(payload).cast("B")
    if not is_envelope(view):
        raise RecordError("epoch record does not start with the envelope magic")
    head, pos = read_json_head(view, "envelope head", MAX_HEAD_BYTES, 8)
    fields = _head_fields(head)
    listing: Listing = {}
    width = 16 + tag_bytes
    for region, count in fields["regions"]:
        if count > (len(view) - pos) // width:
            raise RecordError(f"envelope lists {count} pages of {region!r}; the record holds fewer")
        idxs = struct.unpack_from(f"<{count}Q", view, pos)
        recs = struct.unpack_from(f"<{count}Q", view, pos + 8 * count)
        tags_at = pos + 16 * count
        pos = tags_at + tag_bytes * count
        if any(b <= a for a, b in zip(idxs, idxs[1:])) or (count and idxs[-1] > MAX_PAGE_INDEX):
            raise RecordError(f"envelope page indexes of {region!r} are not strictly increasing in range")
        if any(not 1 <= r <= fields["epoch"] for r in recs):
            raise RecordError(f"envelope lists a page of {region!r} written after its own epoch")
        listing[region] = {i: (r, bytes(view[tags_at + k * tag_bytes:tags_at + (k + 1) * tag_bytes]))
                           for k, (i, r) in enumerate(zip(idxs, recs))}
    env = Envelope(fields["store"], fields["epoch"], fields["base"], fields["name"], fields["created"],
                   fields["meta"], fields["page_bytes"], fields["n_pages"], listing, bytes(view[pos:]),
                   _retained(fields.get("retained"), fields["epoch"]))
    written = sum(1 for pages in listing.values() for r, _ in pages.values() if r == env.epoch)
    if written != env.n_pages:
        raise RecordError(f"envelope says it wrote {env.n_pages} pages but lists {written}")
    return env


def runs(ids: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted ids as inclusive [first, last] runs: [1, 2, 3, 7] -> ((1, 3), (7, 7))."""
    out: list[list[int]] = []
    for i in sorted(set(ids)):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return tuple((a, b) for a, b in out)


def holds(retained: tuple[tuple[int, int], ...], epoch: int) -> bool:
    return any(a <= epoch <= b for a, b in retained)


def _retained(value: Any, epoch: int) -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 1 << 16:
        raise RecordError("envelope retained-epoch list is malformed")
    prev = 0
    for run in value:
        if (not isinstance(run, list) or len(run) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                               for v in run)
                or not prev < run[0] <= run[1] <= epoch):
            raise RecordError("envelope retained-epoch list is malformed")
        prev = run[1]
    return tuple((a, b) for a, b in value)


def _head_fields(head: Any) -> dict[str, Any]:
    if not isinstance(head, dict):
        raise RecordError("envelope head is not an object")
    want = {"store": str, "epoch": int, "base": int, "name": (str, type(None)), "created": (int, float),
            "meta": dict, "page_bytes": int, "n_pages": int, "regions": list}
    for key, kind in want.items():
        value = head.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise RecordError(f"envelope field {key!r} is missing or of the wrong type")
    if not 1 <= head["epoch"] <= MAX_EPOCH or not 0 <= head["base"] < head["epoch"]:
        raise RecordError("envelope epoch / base out of range")
    if not math.isfinite(head["created"]) or head["page_bytes"] < 0 or head["n_pages"] < 0:
        raise RecordError("envelope created / page_bytes / n_pages out of range")
    seen = set()
    for item in head["regions"]:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str) or not item[0]
                or isinstance(item[1], bool) or not isinstance(item[1], int) or item[1] < 0
                or item[0] in seen or len(item[0].encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES):
            raise RecordError("envelope region list is malformed")
        seen.add(item[0])
    return head
