"""Paged attention through shuffled block tables equals contiguous causal attention."""
from __future__ import annotations

import pytest
import torch

from capsule.llm.paged_attention import contiguous_attention, paged_attention, write_kv


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_paged_equals_contiguous(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    bs, hd, nb_pool = 4, 8, 40
    lengths = [13, 1, 7]                                   # three streams of different lengths
    k_cache = torch.zeros(nb_pool, bs, kv_heads, hd)
    v_cache = torch.zeros(nb_pool, bs, kv_heads, hd)
    free = torch.randperm(nb_pool - 1, generator=g).add(1).tolist()   # blocks in scrambled order
    max_blocks = 4
    tables, qs, ks, vs = [], [], [], []
    for n in lengths:
        blocks = [free.pop() for _ in range(-(-n // bs))]
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        q, k, v = (torch.randn(n, h, hd, generator=g) for h in (heads, kv_heads, kv_heads))
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
        write_kv(k_cache, v_cache, slots, k, v)
        qs.append(q), ks.append(k), vs.append(v)
    scale = hd ** -0.5
    # prefill view: every query of each stream at once (B=1 per stream)
    for i, n in enumerate(lengths):
        got = paged_attention(qs[i].unsqueeze(0), k_cache, v_cache, torch.tensor([tables[i]]),
                              torch.arange(n).view(1, n), scale)[0]
        want = contiguous_attention(qs[i], ks[i], vs[i], scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # decode view: the last query of all streams batched together (T=1)
    q_last = torch.stack([q[-1] for q in qs]).unsqueeze(1)             # (B, 1, H, hd)
    pos = torch.tensor([[n - 1] for n in lengths])
    got = paged_attention(q_last, k_cache, v_cache, torch.tensor(tables), pos, scale)[:, 0]
    for i in range(len(lengths)):
        want = contiguous_attention(qs[i], ks[i], vs[i], scale)[-1]
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_write_kv_touches_only_the_given_slots():
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    write_kv(k_cache, v_cache, torch.tensor([3]), torch.ones(1, 1, 4), torch.full((1, 1, 4), 2.0))
    assert k_cache[1, 1].eq(1).all() and v_cache[1, 1].eq(2).all()
    assert k_cache.sum() == 4 and v_cache.sum() == 8


def test_leaving_out_a_wholly_masked_block_keeps_the_result():
    # eager prefill leaves out memory-region blocks with no readable slot; key_pos keeps the
    # causal mask on the stream's positions, so the result is the full one (to float rounding)
    g = torch.Generator().manual_seed(1)
    bs, hd, H, KV = 4, 8, 4, 2
    k_cache = torch.randn(10, bs, KV, hd, generator=g)
    v_cache = torch.randn(10, bs, KV, hd, generator=g)
    table = torch.tensor([[3, 7, 5, 2]])                        # block 7 (index 1) is a hole
    valid = torch.ones(10, bs, dtype=torch.bool)
    valid[7] = False
    q = torch.randn(1, 3, H, hd, generator=g)
    positions = torch.tensor([[12, 13, 14]])
    full = paged_attention(q, k_cache, v_cache, table, positions, hd ** -0.5,
                           key_valid=valid[table].view(1, -1))
    kept = torch.tensor([[3, 5, 2]])
    key_pos = (torch.tensor([[0, 2, 3]]).unsqueeze(-1) * bs + torch.arange(bs)).view(1, -1)
    short = paged_attention(q, k_cache, v_cache, kept, positions, hd ** -0.5,
                            key_valid=valid[kept].view(1, -1), key_pos=key_pos)
    assert torch.allclose(full, short, atol=1e-6, rtol=0)
    # without key_pos the last block's keys (positions 12..15) would sit at 8..11: the queries
    # at 12..14 would see keys after them
    wrong = paged_attention(q, k_cache, v_cache, kept, positions, hd ** -0.5,
                            key_valid=valid[kept].view(1, -1))
    assert not torch.allclose(full, wrong, atol=1e-3)


def test_query_segments_skip_only_keys_that_are_masked_anyway():
    # a prefill chunk across a memory region: queries 0..2 sit before it (positions 0..2), queries
    # 3..4 after it (positions 12, 13); the first segment reads only the first block's keys
    g = torch.Generator().manual_seed(2)
    bs, hd, H, KV = 4, 8, 6, 2
    k_cache = torch.randn(8, bs, KV, hd, generator=g)
    v_cache = torch.randn(8, bs, KV, hd, generator=g)
    table = torch.tensor([[6, 1, 4, 3]])
    q = torch.randn(1, 5, H, hd, generator=g)
    positions = torch.tensor([[0, 1, 2, 12, 13]])
    full = paged_attention(q, k_cache, v_cache, table, positions, hd ** -0.5)
    seg = paged_attention(q, k_cache, v_cache, table, positions, hd ** -0.5,
                          segments=((0, 3, bs), (3, 5, 4 * bs)))
    assert torch.allclose(full, seg, atol=1e-6, rtol=0)
    # cutting keys a segment may see changes its rows: the comparison has teeth
    cut = paged_attention(q, k_cache, v_cache, table, positions, hd ** -0.5,
                          segments=((0, 3, bs), (3, 5, 3 * bs)))
    assert torch.allclose(full[:, :3], cut[:, :3], atol=1e-6, rtol=0)
    assert not torch.allclose(full[:, 3:], cut[:, 3:], atol=1e-3)
    for bad in (((0, 3, bs),), ((0, 3, bs), (2, 5, 16)), ((0, 3, 0), (3, 5, 16)), ((0, 3, bs), (3, 5, 17))):
        with pytest.raises(ValueError, match="segments"):
            paged_attention(q, k_cache, v_cache, table, positions, hd ** -0.5, segments=bad)


def test_gap_segments_cut_at_the_jump():
    from capsule.llm.runner import _gap_segments
    assert _gap_segments([5, 6, 7], None, 4) is None                       # no jump: one pass
    # prefix 0..5, region positions 8..39 (blocks 2..9), then 40, 41: all blocks kept
    assert _gap_segments([4, 5, 40, 41], None, 4) == ((0, 2, 8), (2, 4, 44))
    # blocks 3..9 of the region are skipped: kept indices 0, 1, 2, 10
    assert _gap_segments([4, 5, 40, 41], [0, 1, 2, 10], 4) == ((0, 2, 8), (2, 4, 16))
