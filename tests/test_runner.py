"""Graph runner: buckets, static buffers that never move, padding rows that change nothing."""
from __future__ import annotations

import pytest
import torch

from devices import load_profile
from capsule.llm import BlockTable, DecodeRow, GraphRunner, KVPool, load_model
from capsule.llm.kv_pool import POOL_HEADROOM_MIN, SCRATCH_BLOCK, check_pool_fits
from capsule.state.regions import RegionRegistry
from capsule.errors import CapacityError


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("builtin:tiny", vocab_size=1000)
    return model


def _make(model, buckets=(1, 2, 4, 8)):
    pool = KVPool(model.cfg, pool_bytes=1 << 20, block_size=16, dtype=torch.float32, device="cpu")
    reg = RegionRegistry()
    return GraphRunner(model, pool, reg, buckets=buckets, max_context=256, prefill_chunk=32,
                       use_cuda_graphs=False), pool, reg


def test_bucket_selection(tiny):
    runner, _, _ = _make(tiny)
    assert [runner.bucket_for(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="largest bucket 8"):
        runner.bucket_for(9)
    with pytest.raises(ValueError, match="strictly increasing"):
        _make(tiny, buckets=(2, 1))


def test_registry_lists_every_static_buffer(tiny):
    runner, pool, reg = _make(tiny)
    assert reg.names() == ["kv_pool", "decode.input_ids", "decode.positions", "decode.slot_mapping",
                           "decode.block_tables", "decode.logits"]
    assert reg["kv_pool"].tensor is pool.tensor and reg["kv_pool"].role == "kv"
    assert reg["kv_pool"].page_bytes == pool.block_bytes
    layout = reg.layout()
    assert layout[0]["shape"] == list(pool.tensor.shape) and layout[0]["dtype"] == "float32"


def _streams(runner, pool, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables, ids = [], []
    for n in lengths:
        t = BlockTable(pool)
        toks = torch.randint(0, 1000, (n + 1,), generator=g).tolist()
        runner.prefill(toks[:n], t)
        tables.append(t), ids.append(toks)
    return tables, ids


def _row(t, toks):
    p = t.num_cached
    t.ensure_capacity(p + 1)
    row = DecodeRow(toks[p], p, t.slots(p, p + 1)[0], tuple(t.blocks))
    t.num_cached = p + 1
    return row


def test_static_buffers_keep_their_storage_across_steps(tiny):
    runner, pool, reg = _make(tiny)
    before = reg.data_ptrs()
    tables, ids = _streams(runner, pool, [5, 20, 33])
    for _ in range(3):
        runner.decode([_row(t, i + [0]) for t, i in zip(tables, ids)])
        for i in ids:
            i.append(1)
    assert reg.data_ptrs() == before


def test_batched_decode_with_padding_equals_single_decodes(tiny):
    runner, pool, _ = _make(tiny)
    lengths = [5, 20, 33]                      # 3 rows run in bucket 4: one padding row
    t_a, ids = _streams(runner, pool, lengths, seed=3)
    batched = runner.decode([_row(t, i) for t, i in zip(t_a, ids)]).clone()
    t_b, _ = _streams(runner, pool, lengths, seed=3)
    for k, (t, i) in enumerate(zip(t_b, ids)):
        single = runner.decode([_row(t, i)])[0]
        torch.testing.assert_close(single, batched[k], rtol=1e-5, atol=1e-5)
    # the padding row wrote only into the scratch block, never into a stream's blocks
    used = {b for t in t_a + t_b for b in t.blocks}
    assert SCRATCH_BLOCK not in used


def test_pool_exhaustion_is_a_clear_error(tiny):
    pool = KVPool(tiny.cfg, pool_bytes=4 * 2 * 2 * 2 * 16 * 16 * 4, block_size=16, dtype=torch.float32,
                  device="cpu")                                    # 4 blocks, 3 usable
    assert pool.num_blocks == 4 and pool.capacity_tokens == 48
    t = BlockTable(pool)
    t.ensure_capacity(48)
    t.num_cached = 48
    with pytest.raises(CapacityError, match="kv_pool_mb"):
        BlockTable(pool).ensure_capacity(1)
    t.truncate(17)                                                 # back to 2 blocks
    assert pool.free_blocks == 1 and t.blocks == [1, 2]
    with pytest.raises(CapacityError, match="raise runtime.kv_pool_mb"):
        KVPool(tiny.cfg, pool_bytes=100, block_size=16, dtype=torch.float32, device="cpu")


def test_a_cuda_pool_is_checked_against_free_memory_not_the_profile(tiny, monkeypatch):
    gib = 2**30
    pool = load_profile("cuda-desktop").runtime.kv_pool_bytes        # 4096 MiB, sized for a 24 GB card
    check_pool_fits(pool, 20 * gib, 24 * gib)                         # a free 24 GB card: fits
    check_pool_fits(pool, pool + POOL_HEADROOM_MIN, 4 * gib)          # exactly the headroom left
    with pytest.raises(CapacityError, match=r"3072 MiB free of 8192 MiB.* 819 MiB must stay free.*at most 2252"):
        check_pool_fits(pool, 3 * gib, 8 * gib)                       # an 8 GB card, weights loaded
    with pytest.raises(CapacityError, match="free GPU memory .* or open with device='cpu'"):
        check_pool_fits(pool, 256 * 2**20, 8 * gib)
    # KVPool asks the device before it allocates: the error comes before any CUDA call here
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib, 8 * gib))
    with pytest.raises(CapacityError, match="at most 204"):
        KVPool(tiny.cfg, pool_bytes=pool, block_size=16, dtype=torch.float16, device="cuda")


def test_prefill_rejects_overlong_streams(tiny):
    runner, pool, _ = _make(tiny)
    with pytest.raises(ValueError, match="max_context is 256"):
        runner.prefill(list(range(257)), BlockTable(pool))


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager():
    model, _ = load_model("builtin:tiny", vocab_size=1000, device="cuda")
    pool = KVPool(model.cfg, pool_bytes=1 << 22, block_size=16, dtype=torch.float32, device="cuda")
    graphs = GraphRunner(model, pool, RegionRegistry(), buckets=(1, 2, 4), max_context=256,
                         prefill_chunk=32, use_cuda_graphs=True)
    assert graphs.uses_graphs and set(graphs.capture_seconds) == {1, 2, 4}
    tables, ids = _streams(graphs, pool, [5, 40, 17])
    ptrs = graphs.input_ids.data_ptr(), pool.tensor.data_ptr()
    replayed = graphs.decode([_row(t, i) for t, i in zip(tables, ids)]).clone()
    for t in tables:
        t.num_cached -= 1
    graphs.graphs.clear()                                          # same buffers, eager path
    eager = graphs.decode([_row(t, i) for t, i in zip(tables, ids)])
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    assert (graphs.input_ids.data_ptr(), pool.tensor.data_ptr()) == ptrs


def test_blocks_are_zeroed_when_handed_out(tiny):
    pool = KVPool(tiny.cfg, pool_bytes=1 << 20, block_size=16, dtype=torch.float32, device="cpu")
    pool.tensor.fill_(float("nan"))                 # what uninitialized memory may hold
    t = BlockTable(pool)
    t.ensure_capacity(40)
    assert t.blocks == [1, 2, 3] and pool.dirty == {1, 2, 3}
    assert pool.tensor[[1, 2, 3]].eq(0).all() and pool.tensor[4].isnan().all()
