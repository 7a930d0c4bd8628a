"""Snapshot: turn live state into the pages changed since the last capsule, and back.

Three kinds of pages:
- "kv_pool": block i of every layer; dirty blocks come from the pool's write log (no scan).
- other registered regions (inputs, policy buffers): fixed-size byte pages, compared by digest.
  Role "output" regions are not saved: a step recomputes them from its inputs.
- host blobs ("host/<key>": token ids, text, block tables, RNG state): 4 KiB pages, compared
  with the bytes last written.
Not thread-safe: the checkpointer calls it from the session's thread.
"""
from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Iterable, Iterator

import numpy as np
import torch
import xxhash

from ..errors import CapsuleCorrupt
from ..store.inputs import PageStream
from .host_pages import HOST_PAGE, host_blobs
from .regions import Region, RegionRegistry
KV_REGION = "kv_pool"
# KV blocks go out through one reused staging buffer of about this size (on CUDA also one pinned
# host buffer): a full checkpoint of an 8 GB unified-memory device must not gather the whole pool
# into a second device tensor plus a pinned copy (three pools at once)
STAGING_BYTES = 8 << 20
Page = tuple[str, int, bytes | np.ndarray]   # an ndarray: a view into the staging buffer


def _digest(b: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(b)


def to_host(t: torch.Tensor, side: "torch.cuda.Stream | None" = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Host copy of t. On CUDA the copy goes into pinned memory (`out` when given, a reused
    buffer of t's shape) on a side stream, so it waits only for the work that wrote t, and the
    caller's stream is never blocked by staging."""
    if t.device.type != "cuda":
        return t.detach().contiguous()
    side = side or torch.cuda.Stream(device=t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))   # the step that wrote t comes first
    with torch.cuda.stream(side):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if out is None else out
        host.copy_(t, non_blocking=True)
        t.record_stream(side)                               # keep t alive until the copy ran
    side.synchronize()
    return host


def _as_bytes(t: torch.Tensor, side: "torch.cuda.Stream | None" = None) -> bytes:
    return to_host(t, side).view(torch.uint8).numpy().tobytes()


class Snapshotter:
    """Remembers what the last capsule holds, so the next one writes only what changed."""

    def __init__(self, registry: RegionRegistry, scratch_blocks: Iterable[int] = (0,)):
        self.registry = registry
        self.scratch = set(scratch_blocks)
        self._digests: dict[str, list[int]] = {}
        self._host: dict[str, bytes] = {}
        self.full = True  # the next capture writes every live page (first epoch, after a failed write)
        self._side: "torch.cuda.Stream | None" = None       # staging stream, made on first CUDA use
        self._stage: torch.Tensor | None = None              # (c, L, 2, bs, KV, hd) on the pool's device
        self._stage_host: torch.Tensor | None = None         # its pinned twin (CUDA only)

    @property
    def staging(self) -> torch.Tensor | None:
        """The reused KV staging buffer (None before the first capture of KV blocks)."""
        return self._stage

    def saved_regions(self) -> list[Region]:
        return [r for r in self.registry if r.role not in ("output", "kv")]

    # -- capture ------------------------------------------------------------------------------
    def capture(self, kv_dirty: set[int], kv_live: set[int], blobs: dict[str, bytes], *,
                stream: bool = False) -> list[Page] | PageStream:
        """Pages to write for this epoch. kv_dirty: blocks written since the last capsule;
        kv_live: blocks in some stream's table (all of them go out when `full`).

        stream=False: every page as bytes (what a background writer needs: the live buffers may
        change right after). stream=True: a PageStream whose KV blocks are staged chunk by chunk
        as the store appends them, each page a view into the reused staging buffer, so a full
        checkpoint holds one chunk of the pool in host memory, not all of it (on an 8 GB
        unified-memory device that is the difference between one and two pools). Write it at
        once, before anything changes the pool."""
        blocks: list[int] = []
        if KV_REGION in self.registry:
            picked = (kv_live | kv_dirty) if self.full else kv_dirty
            blocks = sorted(picked - self.scratch)
        rest: list[Page] = []
        for region in self.saved_regions():
            rest += self._region_pages(region)
        for key, blob in blobs.items():
            rest += self._host_pages(key, blob)
        self.full = False
        if not stream:
            return [*self._kv_pages(blocks, copy=True), *rest]
        keys = [(KV_REGION, b) for b in blocks] + [(r, i) for r, i, _ in rest]
        kv_bytes = 0
        if blocks:
            pool = self.registry[KV_REGION].tensor
            kv_bytes = len(blocks) * pool[0].numel() * pool.element_size()
        return PageStream(keys, itertools.chain(self._kv_pages(blocks, copy=False), rest),
                          kv_bytes + sum(len(p) for _, _, p in rest))

    def _kv_pages(self, blocks: list[int], copy: bool) -> Iterator[Page]:
        """The blocks' pages, one staging chunk at a time; copy=False yields views into the
        staging buffer, valid until the next chunk is asked for (on CPU: views of the pool)."""
        if not blocks:
            return
        pool = self.registry[KV_REGION].tensor                               # (NB, L, 2, bs, KV, hd)
        if not copy and pool.device.type == "cpu":   # a region is contiguous (RegionRegistry)
            # each block is one contiguous byte range of the pool: the store reads it in place
            # (written at once, before the pool changes), no staging copy (a full checkpoint of
            # 80 MB of K/V spent 17 of its 112 ms gathering blocks into the staging buffer)
            rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()         # (NB, block bytes)
            for b in blocks:
                yield KV_REGION, b, rows[b]
            return
        stage, host = self._staging(pool)
        per = stage.shape[0]
        for lo in range(0, len(blocks), per):
            chunk = blocks[lo:lo + per]
            n = len(chunk)
            # one gather and one device->host copy per chunk, into the same buffers every time
            torch.index_select(pool, 0, torch.tensor(chunk, device=pool.device), out=stage[:n])
            picked = to_host(stage[:n], self._stream(pool), None if host is None else host[:n])
            raw = picked.view(torch.uint8).numpy().reshape(n, -1)
            for i, b in enumerate(chunk):
                yield KV_REGION, b, (raw[i].tobytes() if copy else raw[i])

    def _staging(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reused staging buffers for KV blocks: STAGING_BYTES worth of blocks (at least one)."""
        block_bytes = pool[0].numel() * pool.element_size()
        per = max(1, min(pool.shape[0], STAGING_BYTES // block_bytes))
        if self._stage is None or self._stage.shape[0] != per or self._stage.device != pool.device \
                or self._stage.dtype != pool.dtype or self._stage.shape[1:] != pool.shape[1:]:
            self._stage = torch.empty((per, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
            self._stage_host = None if pool.device.type != "cuda" else torch.empty(
                self._stage.shape, dtype=pool.dtype, pin_memory=True)
        return self._stage, self._stage_host

    def _region_pages(self, region: Region) -> list[Page]:
        data = _as_bytes(region.tensor, self._stream(region.tensor))
        size = region.page_bytes
        old = self._digests.get(region.name, [])
        new, out = [], []
        for i in range(0, max(1, -(-len(data) // size))):
            page = data[i * size:(i + 1) * size]
            d = _digest(page)
            new.append(d)
            if self.full or i >= len(old) or old[i] != d:
                out.append((region.name, i, page))
        self._digests[region.name] = new
        return out

    def _host_pages(self, key: str, blob: bytes) -> list[Page]:
        old = b"" if self.full else self._host.get(key, b"")
        out = []
        for i in range(0, -(-len(blob) // HOST_PAGE)):
            lo, hi = i * HOST_PAGE, (i + 1) * HOST_PAGE
            if blob[lo:hi] != old[lo:hi]:
                out.append((f"host/{key}", i, blob[lo:hi]))
        self._host[key] = blob
        return out

    def _stream(self, t: torch.Tensor) -> "torch.cuda.Stream | None":
        if t.device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(device=t.device)
        return self._side

    # -- restore ------------------------------------------------------------------------------
    def max_page_bytes(self) -> int:
        """The largest page this layout writes: a KV block, a region page or a host page."""
        sizes = [HOST_PAGE] + [r.page_bytes for r in self.registry if r.role != "output"]
        return max(sizes)

    def prepare(self, pages: dict[str, dict[int, bytes]], blob_sizes: dict[str, int]) -> "Staged":
        """Validate an epoch's page view against this session's layout, rebuild the host blobs and
        build everything `apply` writes. Touches nothing live: a bad capsule changes nothing."""
        kv = self.registry[KV_REGION] if KV_REGION in self.registry else None
        for b, page in pages.get(KV_REGION, {}).items():
            if kv is None or not 0 <= b < kv.tensor.shape[0] or len(page) != kv.page_bytes:
                raise CapsuleCorrupt(f"KV page {b} does not fit this pool ({len(page)} bytes)")
        regions = []
        for region in self.saved_regions():
            nbytes = region.tensor.numel() * region.tensor.element_size()
            got = pages.get(region.name, {})
            want = -(-nbytes // region.page_bytes)
            if sorted(got) != list(range(want)) or sum(len(p) for p in got.values()) != nbytes:
                raise CapsuleCorrupt(f"region {region.name!r}: capsule pages do not cover its {nbytes} bytes")
            data = b"".join(got[i] for i in range(want))
            flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(region.tensor.device)
            digests = [_digest(data[i:i + region.page_bytes]) for i in range(0, len(data), region.page_bytes)]
            regions.append((region, flat, digests))
        return Staged(self._stage_kv(pages.get(KV_REGION, {})), regions, host_blobs(pages, blob_sizes))

    def _stage_kv(self, kv_pages: dict[int, bytes]) -> "_KVStage | None":
        if not kv_pages:
            return None
        pool = self.registry[KV_REGION].tensor                              # (NB, L, 2, bs, KV, hd)
        blocks = sorted(kv_pages)
        if pool.device.type == "cpu":
            # views of the mapped segment: apply copies them straight into the pool
            return _KVStage(blocks, [np.frombuffer(kv_pages[b], dtype=np.uint8) for b in blocks], None, None)
        # CUDA: one pinned buffer uploaded now; apply is a single scatter
        host = torch.empty((len(blocks), *pool.shape[1:]), dtype=pool.dtype, pin_memory=True)
        staging = host.view(len(blocks), -1).view(torch.uint8).numpy()
        for i, b in enumerate(blocks):
            staging[i] = np.frombuffer(kv_pages[b], dtype=np.uint8)
        idx = torch.tensor(blocks, device=pool.device)
        return _KVStage(blocks, [], idx, host.to(pool.device))

    def apply(self, staged: "Staged") -> None:
        """Write prepared pages into the live buffers in place (storage never moves). Only copies
        of buffers whose sizes were checked: nothing here can fail halfway."""
        kv = staged.kv
        if kv is not None:
            pool = self.registry[KV_REGION].tensor
            if kv.device_rows is None:
                dst = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()     # (NB, block bytes)
                for b, row in zip(kv.blocks, kv.rows):
                    dst[b] = row
            else:
                pool.index_copy_(0, kv.index, kv.device_rows)
        for region, flat, digests in staged.regions:
            region.tensor.view(-1).view(torch.uint8).copy_(flat)
            self._digests[region.name] = digests
        # other streams read these buffers next (a policy steps on its own stream, outside this
        # stream's order): the copies land before apply returns
        for dev in {region.tensor.device for region, _, _ in staged.regions if region.tensor.is_cuda}:
            torch.cuda.current_stream(dev).synchronize()
        self._host = dict(staged.blobs)
        self.full = False  # the live state now equals the capsule: the next one is a delta over it


@dataclass(frozen=True)
class _KVStage:
    blocks: list[int]
    rows: list[np.ndarray]                  # CPU: one uint8 row per block
    index: "torch.Tensor | None"            # CUDA: block ids on the device
    device_rows: "torch.Tensor | None"      # CUDA: the blocks, uploaded


@dataclass(frozen=True)
class Staged:
    """An epoch checked against this layout, ready to write in place (Snapshotter.apply)."""
    kv: _KVStage | None
    regions: list[tuple[Region, torch.Tensor, list[int]]]
    blobs: dict[str, bytes]
