"""Part 4 of `capsule bench --suite capsules`: this disk's sequential bandwidth and fsync latency.

Measured in the same run and folder as the capsule stores, so restore throughput can be put
against what the disk (and its page cache) delivers here.
"""
from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

from .timing import percentile

CHUNK = 1 << 20  # 1 MiB reads and writes; O_DIRECT needs an aligned buffer (mmap gives page alignment)


def filesystem_of(path: Path) -> str | None:
    """The filesystem type of the mount holding path (Linux /proc/mounts), e.g. ext4 or tmpfs."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = str(path.resolve())
    best = max((m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


def _read_all(fd: int, buf: Any) -> int:
    total = 0
    while True:
        n = os.readv(fd, [buf])
        if n <= 0:
            return total
        total += n


def sequential_bandwidth(folder: Path, size_mb: int) -> dict[str, Any]:
    """Write size_mb MiB (fsync'd), read it back through the page cache, then with O_DIRECT."""
    path = folder / "seqread.bin"
    block = os.urandom(CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(size_mb):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    size = size_mb * CHUNK
    out: dict[str, Any] = {"file_mb": size_mb, "write_fsync_mb_s": size / write_s / 1e6}

    fd = os.open(path, os.O_RDONLY)  # just written, so served from the page cache
    try:
        t0 = time.perf_counter()
        got = _read_all(fd, bytearray(CHUNK))
        out["cached_read_mb_s"] = got / (time.perf_counter() - t0) / 1e6
    finally:
        os.close(fd)

    out["direct_read_mb_s"], out["direct_read_error"] = None, None
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        out["direct_read_error"] = "os.O_DIRECT is not available on this platform"
    else:
        buf = mmap.mmap(-1, CHUNK)
        try:
            fd = os.open(path, os.O_RDONLY | flag)
            try:
                t0 = time.perf_counter()
                got = _read_all(fd, buf)
                out["direct_read_mb_s"] = got / (time.perf_counter() - t0) / 1e6
            finally:
                os.close(fd)
        except OSError as exc:  # e.g. tmpfs or some overlay filesystems refuse O_DIRECT
            out["direct_read_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            buf.close()
    path.unlink()
    return out


def fsync_latency(folder: Path, reps: int = 50, nbytes: int = 48 * 1024) -> dict[str, Any]:
    """Append nbytes + fdatasync, reps times: what one durable record costs here."""
    path = folder / "fsync.bin"
    block = os.urandom(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            os.write(fd, block)
            sync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return {"append_kb": nbytes // 1024, "reps": reps, "p50_ms": percentile(times, 50) * 1e3,
            "p99_ms": percentile(times, 99) * 1e3}
