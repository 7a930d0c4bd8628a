"""A checkpoint's KV blocks go out through one reused, bounded staging buffer (issue 14, item 10),
or, streamed from a contiguous CPU pool, as views of the pool itself (issue 19: no staging copy):
the pages are the blocks' exact bytes whatever the chunking, and no gather of the whole pool; a
durable checkpoint streams them into the store chunk by chunk, so host memory never holds the
pool's pages all at once."""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
import torch

import capsule.state.snapshot as snapshot
from capsule.state.binding import Binding
from capsule.state.checkpointer import Checkpointer
from capsule.state.regions import RegionRegistry
from capsule.state.snapshot import KV_REGION, Snapshotter
from capsule.store import PageStream, Store


def _pool(nb: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(nb, 2, 2, 16, 3, 8, generator=g)                 # (NB, L, 2, bs, KV, hd)


@pytest.mark.parametrize("staging_blocks", [1, 4, 5, 1000])
def test_kv_pages_are_exact_through_a_bounded_staging_buffer(monkeypatch, staging_blocks):
    pool = _pool()
    block_bytes = pool[0].numel() * pool.element_size()
    monkeypatch.setattr(snapshot, "STAGING_BYTES", staging_blocks * block_bytes)
    reg = RegionRegistry()
    reg.register(KV_REGION, pool, "kv")
    snap = Snapshotter(reg)
    live = set(range(1, pool.shape[0]))                                  # block 0 is scratch
    pages = snap.capture(set(), live, {})
    assert [(r, i) for r, i, _ in pages] == [(KV_REGION, b) for b in sorted(live)]
    for _, b, data in pages:
        assert data == pool[b].contiguous().view(torch.uint8).numpy().tobytes()
    stage = snap.staging
    assert stage.shape[0] == min(staging_blocks, pool.shape[0])          # never the whole pool
    before = stage.data_ptr()
    pool[3] += 1                                                          # a later delta reuses it
    (page,) = snap.capture({3}, live, {})
    assert page[2] == pool[3].contiguous().view(torch.uint8).numpy().tobytes()
    assert snap.staging.data_ptr() == before


def _registry(pool: torch.Tensor) -> RegionRegistry:
    reg = RegionRegistry()
    reg.register(KV_REGION, pool, "kv")
    return reg


def test_a_streamed_capture_stages_each_chunk_only_when_the_store_asks(monkeypatch):
    pool = _pool()
    block_bytes = pool[0].numel() * pool.element_size()
    monkeypatch.setattr(snapshot, "STAGING_BYTES", 4 * block_bytes)
    snap = Snapshotter(_registry(pool))
    live = set(range(1, pool.shape[0]))
    stream = snap.capture(set(), live, {"app": b"x" * 5000}, stream=True)
    assert isinstance(stream, PageStream)
    kv_keys = [(KV_REGION, b) for b in sorted(live)]
    assert stream.keys == kv_keys + [("host/app", 0), ("host/app", 1)]
    assert stream.nbytes == len(live) * block_bytes + 5000
    it = stream.take()
    views = [next(it) for _ in range(4)]
    # a CPU pool's blocks go out as views of the pool itself: nothing staged, nothing copied
    assert snap.staging is None
    pool_bytes = pool.view(torch.uint8).numpy()
    assert all(np.shares_memory(d, pool_bytes) for _, _, d in views)
    for _, b, d in views:
        assert bytes(d) == pool[b].contiguous().view(torch.uint8).numpy().tobytes()
    rest = list(it)
    assert [(r, i) for r, i, _ in rest] == kv_keys[4:] + [("host/app", 0), ("host/app", 1)]
    with pytest.raises(ValueError, match="written once"):
        stream.take()


def _full_checkpoint_peak(tmp_path, wait: bool, stream_full: bool = False) -> tuple[int, int]:
    pool = torch.randn(257, 2, 2, 16, 4, 64)                # 256 live blocks of 64 KiB: 16 MiB
    pool_bytes = (pool.shape[0] - 1) * pool[0].numel() * pool.element_size()
    with Store.open(tmp_path / f"s{int(wait)}{int(stream_full)}") as store:
        snap = Snapshotter(_registry(pool))
        binding = Binding.of(model="m", tokenizer="t", layout={}, dtype="float32", device_class="cpu")
        ck = Checkpointer(store, snap, binding,
                          lambda: (set(), set(range(1, pool.shape[0]))), keep_epochs=4,
                          stream_full=stream_full)
        gc.collect()
        tracemalloc.start()
        try:
            ck.checkpoint(({}, {}), wait=wait, name=None)
            if stream_full:
                assert store.latest_epoch() == 1       # durable on return, whatever wait said
            if not wait:
                _, peak = tracemalloc.get_traced_memory()   # the pages stay held until written
                ck.flush()
            else:
                _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        ck.close()
        _, pages = store.load_epoch(1)
        got = pages[KV_REGION]
        assert sorted(got) == list(range(1, pool.shape[0]))   # every block, its exact bytes
        for b in (1, 100, 256):
            assert bytes(got[b]) == pool[b].contiguous().view(torch.uint8).numpy().tobytes()
    return peak, pool_bytes


def test_a_durable_full_checkpoint_holds_one_chunk_not_the_pool(tmp_path):
    streamed, pool_bytes = _full_checkpoint_peak(tmp_path, wait=True)
    held, _ = _full_checkpoint_peak(tmp_path, wait=False)
    # streamed: the staging chunk (8 MiB) is torch memory, not traced; what Python holds is
    # the segment writer's coalescing buffer and bookkeeping
    assert streamed < pool_bytes // 8, (streamed, pool_bytes)
    assert held >= pool_bytes, (held, pool_bytes)           # the background path's copy


def test_unified_memory_streams_a_full_checkpoint_even_in_the_background(tmp_path):
    # runtime.unified_memory (Jetson profiles): checkpoint(wait=False) of a full capture is
    # written before it returns, streamed, instead of a host copy of the whole pool
    streamed, pool_bytes = _full_checkpoint_peak(tmp_path, wait=False, stream_full=True)
    assert streamed < pool_bytes // 8, (streamed, pool_bytes)
