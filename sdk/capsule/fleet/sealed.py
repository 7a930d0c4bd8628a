"""A small sealed object: magic (8) | head_len u32 | head (JSON) | blob | tag (32).

The tag (wire.Seal, under a domain naming the kind of object) covers everything before it and is
checked before anything is parsed; sizes are bounded before they are read. Fleet memory objects
(factwire.py) and a replica's keyed records (records.py) are such objects.
"""
from __future__ import annotations

import hmac
import struct

from .. import safejson
from .errors import RemoteCorrupt
from .wire import TAG_BYTES, Seal

_HEAD = struct.Struct("<8sI")
MAX_HEAD_BYTES = 1 << 20


def seal_object(magic: bytes, domain: bytes, head: dict, blob: bytes | memoryview, seal: Seal) -> bytes:
    head_bytes = safejson.dumps(head)
    body = _HEAD.pack(magic, len(head_bytes)) + head_bytes + bytes(blob)
    return body + seal.tag(body, domain)


def open_object(data: bytes, magic: bytes, domain: bytes, seal: Seal, where: str, max_blob: int) -> tuple[dict, bytes]:
    """(head, blob) of a verified object; RemoteCorrupt naming `where` otherwise."""
    if not _HEAD.size + TAG_BYTES <= len(data) <= _HEAD.size + MAX_HEAD_BYTES + max_blob + TAG_BYTES:
        raise RemoteCorrupt(where, f"{len(data)} bytes is not a size this object can have")
    body, tag = memoryview(data)[:-TAG_BYTES], bytes(data[-TAG_BYTES:])
    if not hmac.compare_digest(seal.tag(body, domain), tag):
        raise RemoteCorrupt(where, "its tag does not verify (damaged, of another kind, or signed with another "
                                   "fleet key)" if seal.signed else "its SHA-256 does not match (damaged)")
    got, n = _HEAD.unpack_from(body)
    if got != magic or n > min(MAX_HEAD_BYTES, len(body) - _HEAD.size):
        raise RemoteCorrupt(where, "bad magic or head length")
    try:
        head = safejson.loads(body[_HEAD.size:_HEAD.size + n], what="head", max_bytes=MAX_HEAD_BYTES, max_depth=6)
    except ValueError as exc:
        raise RemoteCorrupt(where, str(exc)) from None
    if not isinstance(head, dict):
        raise RemoteCorrupt(where, "head is not an object")
    return head, bytes(body[_HEAD.size + n:])
