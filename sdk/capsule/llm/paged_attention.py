"""Attention that reads keys and values through block tables from the paged KV pool.

The pool is one static tensor (see kv_pool.py); a stream's tokens live in the blocks its
block table lists, in order. Everything here is shape-static given (B, T, n_blocks), so the
same code is captured into a CUDA graph on GPU and runs eagerly on CPU.

The pool may hold K/V in another dtype than the model computes in (runtime.kv_dtype):
`write_kv` rounds the new K/V to the pool's dtype, `paged_attention` reads them back in q's.
Exactness: with the pool in the weights' dtype nothing is rounded (fp32 keeps the 1e-4
logit parity with transformers); an fp16/bf16 pool under fp32 weights is not parity-exact
(each K/V element is rounded once on write), but it is deterministic: the same tokens give
the same pool bytes and logits, so a continuation after a restore is bit-exact.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new keys/values into their slots (slot = block * block_size + offset).

    k_cache, v_cache: (NB, bs, KV, hd) views of one layer (strided: the pool is block-major);
    k, v: (N, KV, hd) in the compute dtype, rounded to the cache's dtype here (a no-op when they
    match); slot_mapping: (N,). Padded batch rows point at the scratch block 0.
    """
    bs = k_cache.shape[1]
    block = torch.div(slot_mapping, bs, rounding_mode="floor")
    offset = slot_mapping - block * bs
    k_cache.index_put_((block, offset), k.to(k_cache.dtype))
    v_cache.index_put_((block, offset), v.to(v_cache.dtype))


def attention_mask(positions: torch.Tensor, S: int, G: int, dtype: torch.dtype,
                   key_valid: torch.Tensor | None = None,
                   key_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask (B, 1, T*G, S): 0 where a query may read a key, -inf elsewhere.

    positions: (B, T) of the queries; key slot s of a stream is position s, or key_pos (B, S)
    when blocks were left out. A query at position p sees keys at positions <= p that
    key_valid (B, S) allows (holes of a memory region are not valid). Every layer uses the
    same mask, so a forward builds it once; G: query heads per kv head (rows are t * G + g).
    """
    B, T = positions.shape
    if key_pos is None:
        key_pos = torch.arange(S, device=positions.device)
    allowed = key_pos.view(-1, 1, S) <= positions.view(B, T, 1)        # (B, T, S)
    if key_valid is not None:
        allowed = allowed & key_valid.view(B, 1, S)
    mask = torch.zeros(B, T, 1, S, dtype=dtype, device=positions.device)
    mask.masked_fill_(~allowed.unsqueeze(2), float("-inf"))           # what SDPA does with a bool mask
    return mask.expand(B, T, G, S).reshape(B, 1, T * G, S)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                    key_valid: torch.Tensor | None = None,
                    key_pos: torch.Tensor | None = None, *,
                    mask: torch.Tensor | None = None,
                    segments: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """Causal attention of queries over their stream's cached keys.

    q: (B, T, H, hd) queries of B streams, T tokens each, at `positions` (B, T);
    k_cache, v_cache: (NB, bs, KV, hd), any float dtype: the gathered blocks are cast to q's;
    block_tables: (B, nb) block ids; key slot s of stream b is position s (see attention_mask
    for key_valid and key_pos). mask: attention_mask's result, when the caller built it once
    for all layers. segments: (q_lo, q_hi, n_keys) host ints covering 0..T: queries
    q_lo..q_hi-1 read only the first n_keys gathered keys, the rest being masked for them
    anyway (a prefill chunk's system-prefix queries skip the memory region after them).
    Returns (B, T, H, hd).
    """
    B, T, H, hd = q.shape
    _, bs, KV, _ = k_cache.shape
    G = H // KV
    S = block_tables.shape[1] * bs
    # index_select copies whole blocks (a memcpy each): ~3x faster on CPU than k_cache[block_tables]
    flat = block_tables.reshape(-1)
    # then to q's dtype (a no-op when the pool is in the compute dtype): SDPA wants one dtype
    k = k_cache.index_select(0, flat).to(q.dtype).view(B, S, KV, hd).transpose(1, 2)  # (B, KV, S, hd)
    v = v_cache.index_select(0, flat).to(q.dtype).view(B, S, KV, hd).transpose(1, 2)
    # group query heads by their kv head so no K/V copy is needed for GQA
    q = q.view(B, T, KV, G, hd).permute(0, 2, 1, 3, 4).reshape(B, KV, T * G, hd)
    if mask is None:
        mask = attention_mask(positions, S, G, q.dtype, key_valid, key_pos)
    if segments is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        ends = [0] + [hi for _, hi, _ in segments]
        if [lo for lo, _, _ in segments] != ends[:-1] or ends[-1] != T \
                or any(not 0 < n <= S for _, _, n in segments):
            raise ValueError(f"segments must cover queries 0..{T} in order, each reading 1..{S} "
                             f"keys, got {list(segments)}")
        out = torch.empty_like(q)
        for lo, hi, n in segments:                                    # rows t * G + g
            rows = slice(lo * G, hi * G)
            out[:, :, rows] = F.scaled_dot_product_attention(
                q[:, :, rows], k[:, :, :n], v[:, :, :n], attn_mask=mask[:, :, rows, :n], scale=scale)
    return out.view(B, KV, T, G, hd).permute(0, 2, 1, 3, 4).reshape(B, T, H, hd)


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference causal attention over contiguous K/V (T, KV, hd) for one stream; q (T, H, hd)."""
    T, H, hd = q.shape
    G = H // k.shape[1]
    k = k.repeat_interleave(G, dim=1).transpose(0, 1)                 # (H, T, hd)
    v = v.repeat_interleave(G, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale          # (H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)                   # (T, H, hd)
