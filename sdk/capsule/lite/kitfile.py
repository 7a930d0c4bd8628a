"""A restore kit's bytes: one file, a checked JSON description followed by checksummed blobs.

Layout: ``MAGIC`` (8 bytes) | the JSON's length n (u64 LE) | the JSON (n bytes, UTF-8) | blobs.
The JSON's ``"blobs"`` maps each blob's name to ``[start, end, xxh3_64]``, offsets counted from
the end of the JSON. The file is untrusted input (it lies beside a store a robot may have lost
power over): the JSON is bounded strict JSON, every offset is checked against the file's size,
and a blob's digest is checked when it is first read, so a torn or flipped kit is refused with
CapsuleCorrupt before anything is built from it. Torch-free.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import xxhash

from .. import safejson
from ..errors import CapsuleCorrupt
from ..store import fsafe

MAGIC = b"CAPSKIT1"
MAX_META = 4 << 20        # a real kit's JSON is a few KB
MAX_BLOBS = 4096


def pack(meta: Mapping[str, Any], blobs: Mapping[str, bytes | memoryview]) -> list[bytes | memoryview]:
    """The kit's bytes, in order, for ``meta`` (without "blobs", which this adds) and ``blobs``."""
    table, offset = {}, 0
    for name, blob in blobs.items():
        table[name] = [offset, offset + len(blob), xxhash.xxh3_64_intdigest(blob)]
        offset += len(blob)
    head = safejson.dumps({**meta, "blobs": table})
    return [MAGIC, struct.pack("<Q", len(head)), head, *blobs.values()]


class KitFile:
    """A mapped kit: ``meta`` (the JSON, shape-checked only) and ``blob(name)``."""

    def __init__(self, path: Path, meta: dict, mapped: mmap.mmap, base: int,
                 table: dict[str, tuple[int, int, int]]):
        self.path, self.meta = path, meta
        self._mapped, self._base, self._table = mapped, base, table
        self._checked: set[str] = set()

    @classmethod
    def open(cls, path: Path) -> "KitFile":
        """CapsuleCorrupt for anything off; FileNotFoundError when there is no kit; UnsafeStore
        for a link or a non-regular file in its place (never followed)."""
        fd = fsafe.open_regular(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < 16:
                raise CapsuleCorrupt(f"restore kit {path} is {size} bytes: not a kit (torn?)")
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if mapped[:8] != MAGIC:
            raise CapsuleCorrupt(f"restore kit {path} does not start with {MAGIC!r}: not a kit of this "
                                 "SDK version; write it again (Session.write_lite_kit)")
        (n,) = struct.unpack("<Q", mapped[8:16])
        if n > min(MAX_META, size - 16):
            raise CapsuleCorrupt(f"restore kit {path}: its description claims {n} bytes, the file has {size}")
        try:
            meta = safejson.loads(mapped[16:16 + n], what=f"restore kit {path}", max_bytes=MAX_META)
            if not isinstance(meta, dict) or not isinstance(meta.get("blobs"), dict):
                raise ValueError(f"restore kit {path}: the description is not an object with 'blobs'")
            base = 16 + n
            table = {}
            if len(meta["blobs"]) > MAX_BLOBS:
                raise ValueError(f"restore kit {path}: {len(meta['blobs'])} blobs, at most {MAX_BLOBS}")
            for name, entry in meta["blobs"].items():
                if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)
                        and 0 <= entry[0] <= entry[1] <= size - base and 0 <= entry[2] < 1 << 64):
                    raise ValueError(f"restore kit {path}: blob {name!r} at {str(entry)[:60]} does not fit "
                                     f"the file ({size} bytes)")
                table[name] = (entry[0], entry[1], entry[2])
        except ValueError as exc:
            raise CapsuleCorrupt(str(exc)) from None
        return cls(path, meta, mapped, base, table)

    def has(self, name: str) -> bool:
        return name in self._table

    def blob(self, name: str) -> memoryview:
        """The blob's bytes (a view of the mapped file), its digest checked on first read."""
        got = self._table.get(name)
        if got is None:
            raise CapsuleCorrupt(f"restore kit {self.path} has no {name!r}: write it again "
                                 "(Session.write_lite_kit)")
        start, end, digest = got
        view = memoryview(self._mapped)[self._base + start:self._base + end]
        if name not in self._checked:
            if xxhash.xxh3_64_intdigest(view) != digest:
                raise CapsuleCorrupt(f"restore kit {self.path}: {name!r} fails its checksum (a torn or "
                                     "damaged kit); write it again (Session.write_lite_kit)")
            self._checked.add(name)
        return view

