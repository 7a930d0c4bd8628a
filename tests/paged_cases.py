"""The paged decode kernels' shared test case: a small block-major pool, three rows of different
live lengths, holes, and the torch reference (capsule.llm.paged_attention at T=1) they are held
to. Used by tests/test_paged_decode_kernel.py (Triton) and tests/test_paged_decode_cpu.py (C).
And decode_rows: a Session's streams as one decode step's inputs (tests/test_decode_attention.py,
tests/test_decode_step_cpu.py)."""
from __future__ import annotations

import torch

from capsule.llm.kv_pool import SCRATCH_BLOCK
from capsule.llm.paged_attention import paged_attention

H, KV, HD, BS, NB, NBLK = 9, 3, 64, 16, 24, 6        # GQA: 3 query heads per kv head


def paged_case(device: str = "cpu", pool_dtype: torch.dtype = torch.float32,
               q_dtype: torch.dtype = torch.float32, seed: int = 0, hd: int = HD) -> dict:
    """A pool of 2 layers, 3 rows of different live lengths (1, across a block edge, full)."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 37, NBLK * BS]
    pool = torch.randn(NB, 2, 2, BS, KV, hd, generator=g).to(device, pool_dtype)
    tables = torch.randperm(NB - 1, generator=g)[:len(lens) * NBLK].add(1).view(len(lens), NBLK)
    valid = torch.ones(NB, BS, dtype=torch.bool)
    valid[tables[1, 0], 2:7] = False                   # holes (memory regions) inside live ranges
    valid[tables[2, 3]] = False                        # a wholly empty block
    q = torch.randn(len(lens), H, hd, generator=g).to(device, q_dtype)  # (B, H, hd)
    return dict(q=q, pool=pool, k=pool[:, 1, 0], v=pool[:, 1, 1],   # strided (NB, bs, KV, hd) views
                tables=tables.to(device), lens=torch.tensor(lens, dtype=torch.int32, device=device),
                valid=valid.to(device))


def paged_reference(c: dict, holes: bool) -> torch.Tensor:
    """torch's paged attention of the case's queries, with or without its holes: (B, H, hd)."""
    B = c["q"].shape[0]
    key_valid = c["valid"][c["tables"]].view(B, -1) if holes else None            # (B, S)
    positions = (c["lens"].long() - 1).view(B, 1)
    return paged_attention(c["q"].unsqueeze(1), c["k"], c["v"], c["tables"], positions,
                           c["q"].shape[-1] ** -0.5, key_valid)[:, 0]           # (B, H, hd)


def decode_rows(s, names: list[str]) -> tuple[torch.Tensor, ...]:
    """(ids (B, 1), positions (B, 1), slots (B,), full block tables (B, nb)) recomputing each of
    Session s's streams' last cached token, padded with the scratch block as the graph path pads."""
    ids, pos, slots, tables = [], [], [], []
    for n in names:
        t = s.engine.streams[n].table
        i = t.num_cached - 1
        p = t.position(i)
        ids.append(s.tokens(n)[i])
        pos.append(p)
        slots.append(t.slots_at([p])[0])
        tables.append(list(t.blocks[:p // s.engine.pool.block_size + 1]))
    width = max(map(len, tables))
    tables = [b + [SCRATCH_BLOCK] * (width - len(b)) for b in tables]
    return (torch.tensor(ids).view(-1, 1), torch.tensor(pos).view(-1, 1), torch.tensor(slots),
            torch.tensor(tables))
