"""The payload of a fact's KV record: self-describing, so a rebuilt index gets the fact back.

Current form: magic `CPFACT\\x02\\x00` | head length (u32) | head (JSON: store id, text, tags,
n_tokens, fingerprint, rope, created) | KV bytes. Two older forms still read: the text binding
(`CPFTEXT\\x01` + SHA-256 of the text, then the KV) and bare KV bytes; neither names the text,
so a rebuild cannot recover their rows (it reports them). The embedding is not in the record:
it is a retrieval cache that memory recomputes when it is missing.

Pure functions over bytes; what is decoded is untrusted (RecordError / ValueError).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from .. import safejson
from .records import JSON_HEAD, MAX_PAYLOAD_BYTES, Buffer, RecordError, read_json_head

MAGIC = b"CPFACT\x02\x00"
_HEAD = JSON_HEAD
MAX_HEAD_BYTES = 1 << 20          # text <= 64 KiB, 64 tags <= 256 B, labels <= 1 KiB: far below
# the older binding: magic, sha256 of the fact's text (UTF-8)
TEXT_BINDING = struct.Struct("<8s32s")
TEXT_BINDING_MAGIC = b"CPFTEXT\x01"


@dataclass(frozen=True)
class FactMeta:
    """What a fact record says about its fact (the row a rebuild makes from it)."""
    store_id: str
    text: str
    tags: tuple[str, ...]
    n_tokens: int
    fingerprint: str
    rope: str
    created: float


def encode(meta: FactMeta, kv: Buffer) -> bytes:
    head = safejson.dumps({"store": meta.store_id, "text": meta.text, "tags": list(meta.tags),
                           "n_tokens": meta.n_tokens, "fingerprint": meta.fingerprint, "rope": meta.rope,
                           "created": meta.created})
    if len(kv) > MAX_PAYLOAD_BYTES - _HEAD.size - len(head):
        raise ValueError(f"kv is {len(kv)} bytes; a fact holds at most {MAX_PAYLOAD_BYTES - _HEAD.size - len(head)}")
    return b"".join((_HEAD.pack(MAGIC, len(head)), head, kv))


def decode(payload: Buffer) -> tuple[FactMeta | None, memoryview]:
    """(what the record says, the KV bytes); meta None for the older forms (RecordError if the
    current form is malformed)."""
    view = memoryview(payload).cast("B")
    if len(view) >= _HEAD.size and bytes(view[:8]) == MAGIC:
        head, pos = read_json_head(view, "fact record head", MAX_HEAD_BYTES, 3)
        return _meta(head), view[pos:]
    if len(view) >= TEXT_BINDING.size and bytes(view[:8]) == TEXT_BINDING_MAGIC:
        return None, view[TEXT_BINDING.size:]
    return None, view


def unbind(payload: Buffer, text: str) -> tuple[memoryview, bool]:
    """(the KV bytes, whether the record names `text`); ValueError when it names another text.
    A bare payload (written before any binding) is all KV, and unbound."""
    view = memoryview(payload).cast("B")
    try:
        meta, kv = decode(view)
    except RecordError as exc:
        raise ValueError(f"the fact record is malformed ({exc})") from None
    if meta is not None:
        if meta.text != text:
            raise ValueError(_EDITED)
        return kv, True
    if len(view) >= TEXT_BINDING.size and bytes(view[:8]) == TEXT_BINDING_MAGIC:
        if TEXT_BINDING.unpack_from(view)[1] != hashlib.sha256(text.encode("utf-8")).digest():
            raise ValueError(_EDITED + " (sha256 mismatch)")
        return kv, True
    return view, False


_EDITED = ("text differs from the text its KV record was encoded from (it was edited in "
           "index.sqlite after the fact was stored)")


def _meta(head: object) -> FactMeta:
    if not isinstance(head, dict):
        raise RecordError("fact record head is not an object")
    want = {"store": str, "text": str, "tags": list, "n_tokens": int, "fingerprint": str, "rope": str,
            "created": (int, float)}
    for key, kind in want.items():
        value = head.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise RecordError(f"fact record field {key!r} is missing or of the wrong type")
    if not all(isinstance(t, str) for t in head["tags"]):
        raise RecordError("fact record tags are not all text")
    return FactMeta(head["store"], head["text"], tuple(head["tags"]), head["n_tokens"], head["fingerprint"],
                    head["rope"], float(head["created"]))
