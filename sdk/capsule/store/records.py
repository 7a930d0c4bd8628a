"""The byte format of segment files: the segment header and the records (see docs/FORMAT.md).

Pure functions over bytes, no I/O. Everything decoded here comes from disk and is untrusted:
every length is checked against fixed maxima and the buffer size before it is used.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Union

import xxhash

from .. import safejson

Buffer = Union[bytes, bytearray, memoryview]

FORMAT_VERSION = 1
# The store format in index meta. 2: kind-3 records exist (an SDK that reads only 1 refuses the
# store instead of compacting them away as dead bytes); 3: the log is self-describing (epoch
# envelopes, keyed records holding their rows, forget records), so the index can be rebuilt
# from it; 4: the index keeps keyed records generically (`records`, `forgotten`, `record_ids`).
# Stores of 1..3 are upgraded to 4 at open; older SDKs refuse 4 rather than misread it.
OLDER_FORMAT_VERSIONS = (1, 2, 3)
STORE_FORMAT_VERSION = 4
SEGMENT_MAGIC = b"CAPSSEG\x00"
# magic, format version, flags, segment id, xxh3_64 of the preceding 16 bytes
SEGMENT_HEADER = struct.Struct("<8sHHIQ")
FLAG_SIGNED = 0x1
RECORD_MAGIC = b"CREC"
# magic, format version, kind, tag kind, epoch, page index, region name length, payload length
# (a keyed record: epoch = its version, page index = its id, region = its collection)
RECORD_HEADER = struct.Struct("<4sHBBQQHQ")
KIND_PAGE, KIND_MANIFEST, KIND_RECORD = 1, 2, 3
# KIND_EPOCH: a manifest wrapped in the store's epoch envelope (envelope.py: store id, epoch
# fields and the listing of every record its view uses); KIND_MANIFEST is the older, bare form.
# KIND_FORGET: a keyed record was forgotten (region = its collection, page index = its id), so a
# rebuilt index forgets it too.
KIND_EPOCH, KIND_FORGET = 4, 5
KINDS = (KIND_PAGE, KIND_MANIFEST, KIND_RECORD, KIND_EPOCH, KIND_FORGET)
TAG_XXH3, TAG_HMAC = 1, 2
TAG_BYTES = {TAG_XXH3: 8, TAG_HMAC: 32}
MAX_NAME_BYTES = 1024
MAX_PAYLOAD_BYTES = 1 << 30
MAX_EPOCH = MAX_PAGE_INDEX = (1 << 63) - 1  # SQLite integers are signed 64-bit
# a manifest is host metadata (small JSON) plus the store's page listing: far below this
MAX_MANIFEST_BYTES = 64 << 20
MAX_RECORD_BYTES = RECORD_HEADER.size + MAX_NAME_BYTES + MAX_PAYLOAD_BYTES + max(TAG_BYTES.values())


class RecordError(ValueError):
    """Bytes that are not a valid record / segment header; str() is the reason."""


@dataclass(frozen=True)
class RecordHeader:
    kind: int
    tag_kind: int
    epoch: int
    index: int
    name_len: int
    payload_len: int

    @property
    def total(self) -> int:
        """Bytes of the whole record: header + name + payload + tag."""
        return RECORD_HEADER.size + self.name_len + self.payload_len + TAG_BYTES[self.tag_kind]


class Sealer:
    """Computes record tags: xxh3_64 (integrity) or HMAC-SHA256 with the store's key (authenticity).
    Stateless after construction: safe to share between threads."""

    def __init__(self, key: bytes | None):
        if key is not None and (not isinstance(key, (bytes, bytearray)) or len(key) < 16):
            raise ValueError("sign_key must be bytes of at least 16 bytes (e.g. os.urandom(32))")
        self._key = bytes(key) if key is not None else None
        self.tag_kind = TAG_HMAC if key is not None else TAG_XXH3

    @property
    def signed(self) -> bool:
        return self._key is not None

    @property
    def tag_bytes(self) -> int:
        return TAG_BYTES[self.tag_kind]

    def tag(self, *parts: Buffer) -> bytes:
        if self._key is None:
            h = xxhash.xxh3_64()
        else:
            h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def key_check(self, store_id: str) -> str:
        """A value stored in the index that proves a later opener holds the same key."""
        if self._key is None:
            return ""
        return hmac.new(self._key, b"capsule.store key check " + store_id.encode(), hashlib.sha256).hexdigest()


# a JSON head inside a record payload: magic (8), head length (u32), head (envelopes, keyed records)
JSON_HEAD = struct.Struct("<8sI")


def read_json_head(view: memoryview, what: str, max_bytes: int, max_depth: int) -> tuple[object, int]:
    """(the head parsed, where what follows it starts) of a payload opening with JSON_HEAD; the
    length is bounded before the head is read (RecordError on anything off)."""
    _, n = JSON_HEAD.unpack_from(view)
    if n > min(max_bytes, len(view) - JSON_HEAD.size):
        raise RecordError(f"{what} claims {n} bytes; the record holds {len(view)}")
    try:
        head = safejson.loads(view[JSON_HEAD.size:JSON_HEAD.size + n], what=what, max_bytes=max_bytes,
                              max_depth=max_depth)
    except ValueError as exc:
        raise RecordError(str(exc)) from None
    return head, JSON_HEAD.size + n


def segment_header(segment: int, signed: bool) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, FLAG_SIGNED if signed else 0, segment, 0)[:16]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def check_segment_header(buf: Buffer, segment: int, signed: bool) -> None:
    if len(buf) < SEGMENT_HEADER.size:
        raise RecordError(f"segment header is truncated ({len(buf)} of {SEGMENT_HEADER.size} bytes)")
    magic, version, flags, seg_id, check = SEGMENT_HEADER.unpack_from(buf)
    if magic != SEGMENT_MAGIC or check != xxhash.xxh3_64_intdigest(bytes(buf[:16])):
        raise RecordError("segment header is damaged (bad magic or checksum)")
    if version != FORMAT_VERSION:
        raise RecordError(f"segment format version {version} is not supported "
                          f"(this SDK reads {FORMAT_VERSION})")
    if seg_id != segment:
        raise RecordError(f"file holds segment {seg_id}, expected {segment} (renamed or copied file?)")
    if bool(flags & FLAG_SIGNED) != signed:
        raise RecordError("segment signing flag does not match the store")


def encode_record(sealer: Sealer, kind: int, epoch: int, region: str, index: int,
                  payload: Buffer) -> tuple[bytes, Buffer, bytes]:
    """(header + name, payload, tag): written back to back they form one record."""
    name = region.encode("utf-8")
    head = RECORD_HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, kind, sealer.tag_kind, epoch, index,
                              len(name), len(payload)) + name
    return head, payload, sealer.tag(head, payload)


def parse_header(buf: Buffer) -> RecordHeader:
    """Decode and bounds-check a record header (the first RECORD_HEADER.size bytes of buf)."""
    if len(buf) < RECORD_HEADER.size:
        raise RecordError(f"record header is truncated ({len(buf)} of {RECORD_HEADER.size} bytes)")
    magic, version, kind, tag_kind, epoch, index, name_len, payload_len = RECORD_HEADER.unpack_from(buf)
    if magic != RECORD_MAGIC:
        raise RecordError("bad record magic (not a record boundary, or overwritten)")
    if version != FORMAT_VERSION:
        raise RecordError(f"record format version {version} is not supported (this SDK reads {FORMAT_VERSION})")
    if kind not in KINDS:
        raise RecordError(f"unknown record kind {kind}")
    if tag_kind not in TAG_BYTES:
        raise RecordError(f"unknown tag kind {tag_kind}")
    if name_len > MAX_NAME_BYTES:
        raise RecordError(f"region name length {name_len} exceeds {MAX_NAME_BYTES}")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise RecordError(f"payload length {payload_len} exceeds {MAX_PAYLOAD_BYTES}")
    if epoch > MAX_EPOCH or index > MAX_PAGE_INDEX:
        raise RecordError("epoch or page index out of range")
    return RecordHeader(kind, tag_kind, epoch, index, name_len, payload_len)


def decode_record(buf: Buffer, sealer: Sealer) -> tuple[RecordHeader, str, memoryview]:
    """Verify one whole record held in buf (exactly its bytes); returns (header, region, payload view)."""
    view = memoryview(buf)
    head = parse_header(view)
    if head.total != len(view):
        raise RecordError(f"record claims {head.total} bytes but {len(view)} are expected")
    if head.tag_kind != sealer.tag_kind:
        raise RecordError("record is not signed but the store is (rewritten without the key?)" if sealer.signed
                          else "record is signed but the store is opened without signing")
    body_end = len(view) - TAG_BYTES[head.tag_kind]
    if not hmac.compare_digest(sealer.tag(view[:body_end]), view[body_end:]):
        raise RecordError("HMAC mismatch (tampered or wrong key)" if sealer.signed else "checksum mismatch")
    name_end = RECORD_HEADER.size + head.name_len
    try:
        region = bytes(view[RECORD_HEADER.size:name_end]).decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("region name is not UTF-8") from None
    return head, region, view[name_end:body_end]
