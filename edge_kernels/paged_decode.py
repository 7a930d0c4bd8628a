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

How it plugs into the runner (not wired yet): the graph path already holds `positions` (B, 1)
as a static buffer, and seq_lens = positions[:, 0] + 1 (padded rows: position 0 on the scratch
block, so length 1, finite). Either register a static int32 `seq_lens` buffer filled in
`_load_rows` next to `positions`, or compute it inside the captured body; then, in
`DecoderModel.forward`, call `paged_decode_attention(q, k_cache, v_cache, block_tables,
seq_lens, scale, slot_valid)` in place of `paged_attention` when T == 1 on CUDA (the mask
build is then not needed). Eager prefill keeps the torch path.

Triton is imported lazily: `edge_kernels` imports without it. On CPU the kernel runs only
under Triton's interpreter (TRITON_INTERPRET=1 set before the first call).
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

_KERNELS: dict[bool, Any] = {}          # keyed by interpreter mode, read at first build


def _triton() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:          # a clear message, not a bare ModuleNotFoundError
        raise ImportError("edge_kernels.paged_decode needs Triton: pip install triton "
                          f"(on CPU, run it with TRITON_INTERPRET=1) ({exc})") from exc
    return triton, tl


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernel() -> Any:
    """Build the jitted kernel once per mode (triton.jit picks the interpreter at decoration)."""
    mode = _interpret()
    if mode in _KERNELS:
        return _KERNELS[mode]
    triton, tl = _triton()

    @triton.jit
    def paged_decode_kernel(Q, K, V, BT, SL, VALID, O, LSE, scale,
                            sq_b, sq_h, sq_d,
                            sk_n, sk_s, sk_h, sk_d,
                            sv_n, sv_s, sv_h, sv_d,
                            sbt_b, sbt_n, svl_n, svl_s,
                            G, HD, BS,
                            HAS_VALID: tl.constexpr, SPLITS: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        kv = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(SL + b).to(tl.int32)
        # this split's share of the row's live tiles: the loop bound follows seq_len
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.cdiv(n_tiles, SPLITS)
        t0 = sp * per
        t1 = tl.minimum(t0 + per, n_tiles)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        gm = g < G
        dm = d < HD
        heads = kv * G + g                                            # (BG,) query heads of kv
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d,
                    mask=gm[:, None] & dm[None, :], other=0.0)        # (BG, BD) in q's dtype
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for t in range(t0, t1):
            s = t * BLOCK_N + n                                       # (BN,) key slots
            live = s < seq_len
            blk = tl.load(BT + b * sbt_b + (s // BS) * sbt_n, mask=live, other=0).to(tl.int64)
            off = s % BS
            if HAS_VALID:   # memory-region holes: never read, never weighted
                live = live & (tl.load(VALID + blk * svl_n + off * svl_s, mask=live, other=0) != 0)
            km = live[:, None] & dm[None, :]
            # cast on read to q's dtype, as paged_attention does (fp16 pool under fp32 q)
            k = tl.load(K + blk[:, None] * sk_n + off[:, None] * sk_s + kv * sk_h + d[None, :] * sk_d,
                        mask=km, other=0.0).to(q.dtype)               # (BN, BD)
            v = tl.load(V + blk[:, None] * sv_n + off[:, None] * sv_s + kv * sv_h + d[None, :] * sv_d,
                        mask=km, other=0.0).to(q.dtype)
            # ieee: no TF32 for fp32 q (the 1e-5 parity); fp16 inputs accumulate in fp32
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BG, BN)
            qk = tl.where(live[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # a tile of holes: no NaN
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        empty = l_i == 0.0                                            # no readable key in this split
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        row = (b * G * tl.num_programs(1) + heads) * SPLITS + sp      # O: (B, H, SPLITS, BD) fp32
        tl.store(O + row[:, None] * BLOCK_D + d[None, :], out, mask=gm[:, None])
        tl.store(LSE + row, lse, mask=gm)                             # LSE: (B, H, SPLITS)

    _KERNELS[mode] = paged_decode_kernel
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
    if dev.type != "cuda" and not _interpret():
        raise RuntimeError("the Triton kernel runs CPU tensors only under its interpreter: "
                           "set TRITON_INTERPRET=1 before the first call")
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
