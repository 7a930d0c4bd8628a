"""Paged decode attention (T=1) in Triton: each row reads only its live key slots.

Semantics are those of `capsule.llm.paged_attention.paged_attention` for one query per row at
position seq_lens[b] - 1: GQA (query head h reads kv head h // G), keys at slots
0..seq_lens[b]-1 of the row's block table, minus the holes `slot_valid` (NB, bs) marks (memory
regions), K/V cast from the pool's dtype to q's on read, softmax scaled by `scale`.

Why a kernel: the graph path of `llm/runner.py` gathers all `max_blocks` of every row per layer
(`index_select` over the static (B, max_blocks) table), so a replay for a short stream moves
the whole max_context of K/V. Here the grid is fixed (B, KV, splits) and the key loop's bound
is loaded from `seq_lens` on the device, so a replayed graph does work proportional to each
row's live length while every launch argument stays the same.

How it plugs in: `runtime={"decode_attention": "triton"}` makes `Decoder.forward` call it for
one query per row over a full block table (graph decode, and eager decode when no memory-region
block is skipped), with seq_lens = positions[:, 0] + 1 computed on the device (padded rows:
position 0 on the scratch block, length 1), so a captured graph replays it unchanged. Prefill
and eager decode that skips blocks keep the torch path.

Triton is imported lazily: `edge_kernels` imports without it. On CPU the kernel runs only
under Triton's interpreter (TRITON_INTERPRET=1 set before the first call).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .triton_mode import check_runnable


def _kernel() -> Any:
    """The jitted kernel. Triton picks the interpreter when it is first imported (the
    TRITON_INTERPRET environment variable at that moment), so set it before anything imports it."""
    try:
        from .paged_decode_kernel import paged_decode_kernel
    except ImportError as exc:          # a clear message, not a bare ModuleNotFoundError
        raise ImportError("edge_kernels.paged_decode needs Triton: pip install triton "
                          f"(on CPU, run it with TRITON_INTERPRET=1) ({exc})") from exc
    return paged_decode_kernel


def _pow2(x: int, lo: int) -> int:
    return max(lo, 1 << max(0, (x - 1).bit_length()))


def default_splits(B: int, KV: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Splits of the key range per (row, kv head): enough programs to fill the GPU at batch 1.
    Fixed per launch shape (a graph bakes it in); empty splits cost one early exit."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(max_keys / block_n), (2 * sms) // max(1, B * KV), 16))


def decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                slot_valid: torch.Tensor | None) -> tuple[bool, torch.Tensor]:
    """Checks a decode call's shapes and devices (ValueError saying which); returns (whether q
    came as (B, 1, H, hd), q as (B, H, hd)). Shared by the Triton and the CPU kernel."""
    squeeze = q.dim() == 4
    if squeeze:
        if q.shape[1] != 1:
            raise ValueError(f"decode takes one query per row, got q {tuple(q.shape)}")
        q = q[:, 0]
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, hd) or (B, 1, H, hd), got {tuple(q.shape)}")
    B, H, hd = q.shape
    NB, bs, KV, hd_k = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or hd_k != hd or H % KV:
        raise ValueError(f"k/v caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
                         f"q {tuple(q.shape)} (need (NB, bs, KV, {hd}) with H % KV == 0)")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"block_tables must be ({B}, nb) and seq_lens ({B},), got "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}")
    if slot_valid is not None and tuple(slot_valid.shape) != (NB, bs):
        raise ValueError(f"slot_valid must be the pool's ({NB}, {bs}), got {tuple(slot_valid.shape)}")
    dev = q.device
    others = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
              "seq_lens": seq_lens, "slot_valid": slot_valid}
    for name, t in others.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}: all on one device")
    return squeeze, q


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           slot_valid: torch.Tensor | None = None, *,
                           num_splits: int | None = None, block_n: int = 64) -> torch.Tensor:
    """Decode attention of one query per row over its live key slots.

    q: (B, H, hd) or (B, 1, H, hd); k_cache, v_cache: (NB, bs, KV, hd), any strides, any float
    dtype (cast to q's on read); block_tables: (B, nb) int32/int64; seq_lens: (B,) device int
    tensor, live key slots per row (>= 1 for a finite result; 1 <= seq_lens <= nb * bs);
    slot_valid: the pool's (NB, bs) bool mask of readable slots, or None. Returns q's shape.
    """
    squeeze, q = decode_args(q, k_cache, v_cache, block_tables, seq_lens, slot_valid)
    B, H, hd = q.shape
    NB, bs, KV, _ = k_cache.shape
    dev = q.device
    check_runnable(dev, "paged decode kernel")
    G = H // KV
    BLOCK_G, BLOCK_D, BLOCK_N = _pow2(G, 16), _pow2(hd, 16), _pow2(block_n, 16)  # tl.dot: >= 16
    splits = num_splits or default_splits(B, KV, block_tables.shape[1] * bs, BLOCK_N, dev)
    o = torch.empty(B, H, splits, BLOCK_D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, H, splits, dtype=torch.float32, device=dev)
    valid = slot_valid.view(torch.uint8) if slot_valid is not None else seq_lens  # a dummy pointer
    kernel: Callable[..., Any] = _kernel()
    kernel[(B, KV, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, valid, o, lse, float(scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *(valid.stride() if slot_valid is not None else (0, 0)),
        G, hd, bs,
        HAS_VALID=slot_valid is not None, SPLITS=splits,
        BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    out = combine_splits(o[..., :hd], lse).to(q.dtype)                # (B, H, hd)
    return out.unsqueeze(1) if squeeze else out


def combine_splits(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge per-split normalized outputs o (B, H, S, hd) by their log-sum-exp lse (B, H, S)."""
    if o.shape[2] == 1:
        return o[:, :, 0]
    top = lse.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # all splits empty: weights 0
    w = torch.exp(lse - top)                                          # (B, H, S); empty split: 0
    return (w.unsqueeze(-1) * o).sum(2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
