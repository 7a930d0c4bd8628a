"""An independent reader of segment files, written from docs/FORMAT.md (not from the store's code):
which records are intact in a (damaged) folder, and so which epochs could still be restored.

Used by the segment-damage oracle: a store that raises CapsuleCorrupt while an epoch is still
intact on disk refused data it had; one that restores an epoch must give that epoch's bytes.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

import xxhash

from . import reliability_harness as H

SEG_HEADER = struct.Struct("<8sHHIQ")
REC_HEADER = struct.Struct("<4sHBBQQHQ")
TAGS = {1: 8, 2: 32}
MANIFEST_KINDS = (2, 4)   # a bare manifest, or one wrapped in the epoch envelope
MAX_PAYLOAD = 1 << 30


def _tag(key: bytes | None, body: memoryview) -> bytes:
    if key is None:
        return xxhash.xxh3_64(body).digest()
    return hmac.new(key, body, hashlib.sha256).digest()


def header_ok(data: bytes, seg_id: int, key: bytes | None) -> bool:
    if len(data) < SEG_HEADER.size:
        return False
    magic, version, flags, sid, check = SEG_HEADER.unpack_from(data)
    return (magic == b"CAPSSEG\x00" and version == 1 and sid == seg_id and bool(flags & 1) == (key is not None)
            and check == xxhash.xxh3_64_intdigest(data[:16]))


def scan_records(data: bytes, key: bytes | None) -> dict[tuple[int, int, str, int], bytes]:
    """(kind, epoch, region, index) -> payload of every record that verifies, found by magic."""
    found: dict[tuple[int, int, str, int], bytes] = {}
    view, want_tag = memoryview(data), 2 if key is not None else 1
    pos = SEG_HEADER.size
    while True:
        off = data.find(b"CREC", pos)
        if off < 0 or off + REC_HEADER.size > len(data):
            return found
        _, version, kind, tag_kind, epoch, index, name_len, plen = REC_HEADER.unpack_from(data, off)
        total = REC_HEADER.size + name_len + plen + TAGS.get(tag_kind, 0)
        if (version != 1 or tag_kind != want_tag or name_len > 1024 or plen > MAX_PAYLOAD
                or off + total > len(data)):
            pos = off + 1
            continue
        body_end = off + total - TAGS[tag_kind]
        if _tag(key, view[off:body_end]) != data[body_end:off + total]:
            pos = off + 1
            continue
        name_end = off + REC_HEADER.size + name_len
        try:
            region = data[off + REC_HEADER.size:name_end].decode("utf-8")
        except UnicodeDecodeError:
            pos = off + 1
            continue
        found.setdefault((kind, epoch, region, index), data[name_end:body_end])
        pos = off + total


def intact_records(folder: Path, key: bytes | None) -> dict[tuple[int, int, str, int], bytes]:
    """Every verifying record of every segment file whose header is intact (a reader checks the
    header before any record of the file). Files under a quarantine/ folder count too."""
    found: dict[tuple[int, int, str, int], bytes] = {}
    files = list((folder / "segments").glob("*.seg")) + [p for p in folder.rglob("*.seg")
                                                        if "quarantine" in p.parts]
    for path in files:
        try:
            seg_id = int(path.stem)
        except ValueError:
            continue
        data = path.read_bytes()
        if header_ok(data, seg_id, key):
            for k, v in scan_records(data, key).items():
                found.setdefault(k, v)
    return found


def intact_epochs(folder: Path, key: bytes | None, epochs: list[int]) -> list[int]:
    """Which of `epochs` still have their manifest and every page of their view intact on disk."""
    recs = intact_records(folder, key)
    manifests = {(k[1]) for k in recs if k[0] in MANIFEST_KINDS and k[2] == "" and k[3] == 0}
    out = []
    for e in epochs:
        if e not in manifests:
            continue
        if all(recs.get((1, w, r, i)) == H.page(w, r, i) for r, i, w in H.view_keys(e)):
            out.append(e)
    return out
