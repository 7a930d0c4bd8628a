"""Damage generators for the reliability campaign: deterministic given the rng, each returns a
description (kind, file, offsets / bits / lengths) that goes into a failure's recipe.

index.sqlite / -wal / -shm: bit flips anywhere or in hot spots (the database header, b-tree page
headers, the WAL header and frame headers), cuts, torn tails at sector boundaries, deleted files,
swapped or zeroed 4 KiB pages, zeroed ranges. Segments: bit flips (anywhere, in record headers,
in the segment header), torn tails, cuts, zeroed ranges, deleted files.
"""
from __future__ import annotations

import random
from pathlib import Path

INDEX_FILES = ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm")
INDEX_KINDS = ("flip", "flip-hot", "cut", "torn", "delete", "swap-pages", "zero-page", "zero-range", "delete-wal-shm")
SEGMENT_KINDS = ("flip", "flip-header", "flip-seg-header", "torn-tail", "cut", "zero-range", "delete")


def _flip(path: Path, offsets: list[int], rng: random.Random) -> list[tuple[int, int]]:
    data = bytearray(path.read_bytes())
    done = []
    for off in offsets:
        if 0 <= off < len(data):
            bit = rng.randrange(8)
            data[off] ^= 1 << bit
            done.append((off, bit))
    path.write_bytes(bytes(data))
    return done


def _pages(size: int) -> int:
    return max(1, size // 4096)


def damage_index(folder: Path, rng: random.Random) -> dict:
    present = [n for n in INDEX_FILES if (folder / n).exists()]
    kind = rng.choice(INDEX_KINDS)
    if kind == "delete-wal-shm":
        for n in INDEX_FILES[1:]:
            (folder / n).unlink(missing_ok=True)
        return {"kind": kind, "file": "index.sqlite-wal+shm"}
    weights = {"index.sqlite": 3, "index.sqlite-wal": 5, "index.sqlite-shm": 2}   # the WAL holds most rows
    name = rng.choices(present, [weights[n] for n in present])[0]
    path = folder / name
    size = path.stat().st_size
    d: dict = {"kind": kind, "file": name, "size": size}
    if kind == "delete":
        path.unlink()
    elif kind == "cut":
        d["to"] = rng.randrange(0, max(1, size))
        _truncate(path, d["to"])
    elif kind == "torn":          # a torn tail: cut at a sector boundary in the last quarter
        d["to"] = min(size, (rng.randrange(size * 3 // 4, size + 1) // 512) * 512) if size else 0
        _truncate(path, d["to"])
    elif kind in ("flip", "flip-hot"):
        if kind == "flip" or size < 200:
            offs = [rng.randrange(size) for _ in range(rng.randint(1, 3))] if size else []
        elif name == "index.sqlite-wal":   # the WAL header (32 B) or a frame header (24 B per 4120)
            frames = max(1, (size - 32) // 4120)
            offs = [rng.randrange(32) if rng.random() < 0.3 else 32 + rng.randrange(frames) * 4120 + rng.randrange(24)]
        else:                              # the database header, or a b-tree page header
            offs = [rng.randrange(100) if rng.random() < 0.4 else rng.randrange(_pages(size)) * 4096 + rng.randrange(12)]
        d["flips"] = _flip(path, offs, rng)
    else:
        data = bytearray(path.read_bytes())
        n = _pages(size)
        if kind == "swap-pages" and n >= 2:
            a, b = rng.sample(range(n), 2)
            pa, pb = bytes(data[a * 4096:(a + 1) * 4096]), bytes(data[b * 4096:(b + 1) * 4096])
            data[a * 4096:a * 4096 + len(pa)], data[b * 4096:b * 4096 + len(pb)] = pb[:len(pa)], pa[:len(pb)]
            d["pages"] = (a, b)
        elif kind == "zero-page" or (kind == "swap-pages" and n < 2):
            p = rng.randrange(n)
            data[p * 4096:(p + 1) * 4096] = bytes(len(data[p * 4096:(p + 1) * 4096]))
            d["page"] = p
        else:
            off = rng.randrange(max(1, size))
            ln = rng.randint(1, 512)
            data[off:off + ln] = bytes(len(data[off:off + ln]))
            d["range"] = (off, ln)
        path.write_bytes(bytes(data))
    return d


def _truncate(path: Path, length: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(length)


def damage_segments(folder: Path, rng: random.Random) -> dict:
    files = sorted((folder / "segments").glob("*.seg"))
    kind = rng.choice(SEGMENT_KINDS)
    path = files[-1] if rng.random() < 0.5 or kind == "torn-tail" else rng.choice(files)
    data = path.read_bytes()
    size = len(data)
    d: dict = {"kind": kind, "file": path.name, "size": size}
    if kind == "flip":
        d["flips"] = _flip(path, [rng.randrange(size) for _ in range(rng.randint(1, 3))], rng)
    elif kind == "flip-header":         # inside a record header (its magic, kind, ids or lengths)
        starts = [i for i in range(size) if data.startswith(b"CREC", i)] or [24]
        d["flips"] = _flip(path, [rng.choice(starts) + rng.randrange(34)], rng)
    elif kind == "flip-seg-header":
        d["flips"] = _flip(path, [rng.randrange(24)], rng)
    elif kind == "torn-tail":
        d["to"] = max(0, size - rng.randint(1, min(size, 3000)))
        _truncate(path, d["to"])
    elif kind == "cut":
        d["to"] = rng.randrange(size)
        _truncate(path, d["to"])
    elif kind == "zero-range":
        off, ln = rng.randrange(size), rng.randint(1, 4096)
        buf = bytearray(data)
        buf[off:off + ln] = bytes(len(buf[off:off + ln]))
        path.write_bytes(bytes(buf))
        d["range"] = (off, ln)
    else:
        path.unlink()
    return d
