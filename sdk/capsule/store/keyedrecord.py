"""The payload of a keyed record: self-describing, so a rebuilt index gets the record's row back.

Current form: magic `CPFACT\\x02\\x00` (named after its first user; the bytes are kept so older
stores read unchanged) | head length (u32) | head (JSON: {"store": store id, **the caller's row})
| the caller's opaque blob. Any other payload is *headless* (written by an older SDK): the store
hands it out whole and cannot rebuild its row from the log (a rebuild reports it).

Pure functions over bytes; what is decoded is untrusted (RecordError).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import safejson
from .records import JSON_HEAD, MAX_PAYLOAD_BYTES, Buffer, RecordError, read_json_head

MAGIC = b"CPFACT\x02\x00"
MAX_HEAD_BYTES = 1 << 20          # the row's bound (keyedrows.MAX_ROW_BYTES) plus the store id


@dataclass(frozen=True)
class Head:
    """What a current-form record says of itself: the store that wrote it and the row."""
    store_id: str
    row: dict[str, Any]


def encode(store_id: str, row: dict[str, Any], blob: Buffer) -> bytes:
    head = safejson.dumps({"store": store_id, **row})   # key order kept: same bytes as before
    if len(head) > MAX_HEAD_BYTES:
        raise ValueError(f"the row is {len(head)} bytes as JSON; a record's head holds at most {MAX_HEAD_BYTES}")
    room = MAX_PAYLOAD_BYTES - JSON_HEAD.size - len(head)
    if len(blob) > room:
        raise ValueError(f"the blob is {len(blob)} bytes; a record holds at most {room}")
    return b"".join((JSON_HEAD.pack(MAGIC, len(head)), head, blob))


def decode(payload: Buffer) -> tuple[Head | None, memoryview]:
    """(the head, the blob); head None for a headless payload (then the blob is all of it).
    RecordError when a current-form payload is malformed."""
    view = memoryview(payload).cast("B")
    if len(view) < JSON_HEAD.size or bytes(view[:8]) != MAGIC:
        return None, view
    head, pos = read_json_head(view, "record head", MAX_HEAD_BYTES, 4)
    if not isinstance(head, dict) or not isinstance(head.get("store"), str):
        raise RecordError("record head is not an object naming its store")
    row = {k: v for k, v in head.items() if k != "store"}
    return Head(head["store"], row), view[pos:]
