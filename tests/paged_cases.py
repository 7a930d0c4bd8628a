"""The paged decode kernels' shared test case: a small block-major pool, three rows of different
live lengths, holes, and the torch reference (capsule.llm.paged_attention at T=1) they are held
to. Used by tests/test_paged_decode_kernel.py (Triton) and tests/test_paged_decode_cpu.py (C)."""
from __future__ import annotations

import torch

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
