"""Per-vocabulary disk cache: a later process gets a tokenizer's identity and decode table in ms.

``cache_dir()/tokenizers/<slug>-<hash>/`` holds ``meta.json`` (identity, stamps of the source
files, digest of the table), ``offsets.u32`` ((max_id + 2) little-endian uint32 offsets) and
``blob.bin`` (every token's bytes back to back; a missing id is an empty span). The cache is only
a speed-up: anything that does not check out is ignored, and a full load rewrites it.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import operator
import os
import re
import shutil
import sys
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Sequence

from ..paths import cache_dir
from .families import Parts, _bad_ids

FORMAT = 2                 # bump when the layout or the meaning of a field changes
_MAX_META = 64 << 20       # a meta.json past this is garbage, not a vocabulary
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_OWN_FILES = sorted(Path(__file__).parent.glob("*.py"))   # our code decides the tables too




def clear_disk_cache() -> None:
    """Delete every cached tokenizer table (the next load of each is a full one)."""
    shutil.rmtree(cache_dir() / "tokenizers", ignore_errors=True)


@dataclass(frozen=True)
class Entry:
    """One vocabulary's cache folder, and what its meta.json must say to be used."""
    folder: Path
    ident: Any    # [FORMAT, in-process key, name], as JSON gives it back
    stamp: list   # [path, size, mtime_ns] per source file (size None: absent)


def _stamps(files: Sequence[Path]) -> list:
    out: list = []
    for path in files:
        try:
            st = os.stat(path)
        except FileNotFoundError:   # optional files (tokenizer_config.json) may be absent
            out.append([str(path), None, None])
        else:
            out.append([str(path), st.st_size, st.st_mtime_ns])
    return out


def entry(key: Hashable, name: str, sources: Sequence[Path] | None) -> Entry | None:
    """The cache entry of a vocabulary read from ``sources`` (stamped now: before its load)."""
    if sources is None:
        return None
    try:
        stamp = _stamps([*sources, *_OWN_FILES])
        ident = json.loads(json.dumps([FORMAT, key, name]))
    except (OSError, TypeError, ValueError):
        return None
    # Source paths go into the folder name: two installs sharing a cache do not evict each other.
    digest = hashlib.sha256(json.dumps([ident, [s[0] for s in stamp]]).encode()).hexdigest()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name.rsplit("/", 1)[-1])[:40]
    return Entry(cache_dir() / "tokenizers" / f"{slug}-{digest[:24]}", ident, stamp)


def unchanged(ent: Entry) -> bool:
    """Whether every source file still has the size and mtime it had when ``ent`` was made."""
    try:
        return _stamps([Path(s[0]) for s in ent.stamp]) == ent.stamp
    except OSError:
        return False


class DecodeTable:
    """Token bytes by id, served from the cached offsets and blob (no encoder needed)."""

    __slots__ = ("_name", "_off", "_blob")

    def __init__(self, name: str, offsets: array, blob: bytes) -> None:
        self._name, self._off, self._blob = name, offsets, blob

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        off, blob, end = self._off, self._blob, len(self._off) - 1
        out = []
        try:
            for i in ids:
                i = operator.index(i)
                # 0 <= i first: a negative index would wrap; an empty span is an id with no token
                if not 0 <= i < end or off[i] == off[i + 1]:
                    raise KeyError(f"no token with id {i}")
                out.append(blob[off[i]:off[i + 1]])
        except (KeyError, TypeError) as exc:
            raise _bad_ids(self._name, exc) from exc
        return b"".join(out)


@dataclass(frozen=True)
class Cached:
    """A vocabulary as its cache describes it; ``table`` is None when decode needs the encoder."""
    max_id: int
    special_tokens: dict[str, int]
    pattern: str | None
    normalization: str | None
    eos_ids: tuple[int, ...]
    fingerprint: str
    byte_level: bool
    pieces: bool
    table: DecodeTable | None
    pipeline: str | None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read(path: Path, size: int | None, limit: int = _MAX_META) -> bytes | None:
    """The file's bytes if it is exactly ``size`` long (or at most ``limit`` when size is None)."""
    with open(path, "rb") as f:
        n = os.fstat(f.fileno()).st_size
        if n > limit if size is None else n != size:
            return None
        data = f.read(n + 1)
    return data if len(data) == n else None


def _table(folder: Path, name: str, max_id: int, meta: dict) -> DecodeTable | None:
    blob_size, digest = meta.get("blob_size"), meta.get("digest")
    if not _is_int(blob_size) or not 0 <= blob_size < 1 << 32 or not isinstance(digest, str):
        return None
    raw = _read(folder / "offsets.u32", 4 * (max_id + 2))
    blob = _read(folder / "blob.bin", blob_size)
    if raw is None or blob is None or _digest(raw, blob) != digest:
        return None
    import numpy as np   # already loaded with capsule; a Python loop costs 5-10 ms here
    off = np.frombuffer(raw, dtype="<u4")
    if off[0] != 0 or int(off[-1]) != len(blob) or bool((off[1:] < off[:-1]).any()):
        return None
    offsets = array("I")
    if offsets.itemsize != 4:
        return None
    offsets.frombytes(raw)
    if sys.byteorder == "big":
        offsets.byteswap()
    return DecodeTable(name, offsets, blob)


def load(ent: Entry, name: str) -> Cached | None:
    """The cached vocabulary if its files check out against ``ent``; else None (full load)."""
    try:
        raw = _read(ent.folder / "meta.json", None)
        meta = json.loads(raw) if raw is not None else None
        if (not isinstance(meta, dict) or meta.get("format") != FORMAT
                or meta.get("ident") != ent.ident or meta.get("stamp") != ent.stamp):
            return None
        max_id, specials, eos = meta.get("max_id"), meta.get("special_tokens"), meta.get("eos_ids")
        pattern, norm, fp = meta.get("pattern"), meta.get("normalization"), meta.get("fingerprint")
        pipeline = meta.get("pipeline")
        flags = (meta.get("byte_level"), meta.get("pieces"), meta.get("table"))
        if (not _is_int(max_id) or not 0 <= max_id < 1 << 31
                or not isinstance(specials, dict) or not isinstance(eos, list)
                or not all(isinstance(t, str) and _is_int(i) and 0 <= i <= max_id
                           for t, i in specials.items())
                or not all(_is_int(i) and 0 <= i <= max_id for i in eos)
                or eos != sorted(set(eos))
                or not all(v is None or isinstance(v, str) for v in (pattern, norm, pipeline))
                or not isinstance(fp, str) or not _HEX64.match(fp)
                or not all(isinstance(v, bool) for v in flags)):
            return None
        table = _table(ent.folder, name, max_id, meta) if flags[2] else None
        if flags[2] and table is None:
            return None
        return Cached(max_id, specials, pattern, norm, tuple(eos), fp, flags[0], flags[1], table,
                      pipeline)
    except (OSError, ValueError, RecursionError):   # unreadable, not JSON, nested too deep
        return None


def _digest(offsets: bytes, blob: bytes) -> str:
    import xxhash   # ~0.1 ms over a 250k-token table; catches torn or bit-flipped files
    h = xxhash.xxh3_128(offsets)
    h.update(blob)
    return h.hexdigest()


def _build_table(parts: Parts) -> tuple[bytes, bytes] | None:
    """(offsets, blob) from the reference's own decode_bytes of each id: equal by construction."""
    pieces = []
    for i in range(parts.max_id + 1):
        try:
            b = parts.decode_bytes([i])
        except ValueError:
            b = b""   # no token has this id: an empty span, which DecodeTable rejects
        else:
            if not b:
                return None   # a real empty token would read as missing: serve decode live
        pieces.append(b)
    offsets = array("I", [0])
    offsets.extend(itertools.accumulate(map(len, pieces)))
    if offsets.itemsize != 4 or offsets[-1] >= 1 << 32:
        return None
    if sys.byteorder == "big":
        offsets.byteswap()
    return offsets.tobytes(), b"".join(pieces)


def _write(folder: Path, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")   # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / name)   # no fsync: a torn file fails its digest, or its JSON
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def store(ent: Entry, name: str, parts: Parts, fingerprint: str) -> None:
    """Write ``ent``'s cache from a full load. Never raises: a failure only costs the next load."""
    try:
        table = _build_table(parts) if parts.byte_level else None
        meta: dict[str, Any] = {
            "format": FORMAT, "ident": ent.ident, "stamp": ent.stamp, "name": name,
            "max_id": parts.max_id, "special_tokens": dict(parts.special_tokens),
            "pattern": parts.pattern, "normalization": parts.normalization,
            "eos_ids": list(parts.eos_ids),
            "fingerprint": fingerprint, "byte_level": parts.byte_level,
            "pieces": parts.piece_spans is not None, "table": table is not None,
            "pipeline": parts.pipeline}
        if table is not None:
            meta.update(blob_size=len(table[1]), digest=_digest(*table))
        if not unchanged(ent):   # the files changed while loading: the stamps would lie
            return
        for folder in reversed([ent.folder, *ent.folder.parents]):
            if not folder.is_dir():
                folder.mkdir(mode=0o700, exist_ok=True)   # parents=True would skip the mode
        if table is not None:   # the table first: meta.json names its digest
            _write(ent.folder, "offsets.u32", table[0])
            _write(ent.folder, "blob.bin", table[1])
        _write(ent.folder, "meta.json", json.dumps(meta).encode())
    except Exception:   # read-only disk, full disk, odd paths: the cache is only a speed-up
        pass


def discard(ent: Entry) -> None:
    """Remove one entry (its contents contradicted a full load)."""
    shutil.rmtree(ent.folder, ignore_errors=True)
