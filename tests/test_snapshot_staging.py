"""A checkpoint's KV blocks go out through one reused, bounded staging buffer (issue 14, item 10):
the pages are the blocks' exact bytes whatever the chunking, and no gather of the whole pool."""
from __future__ import annotations

import pytest
import torch

import capsule.state.snapshot as snapshot
from capsule.state.regions import RegionRegistry
from capsule.state.snapshot import KV_REGION, Snapshotter


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
