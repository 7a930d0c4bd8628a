"""RoPE rotate + scatter: inject pre-RoPE memory-fact K/V into the paged KV pool.

A fact's keys are stored unrotated, so one encoding serves at any position: here they are
rotated to their serving positions (rotate-half convention, Llama / Qwen2) and written,
with the values, into their pool slots. Torch reference; runs on CPU and CUDA alike.

Kept low in the dependency order: this module imports nothing from `capsule` at import
time (the error type is imported lazily), and never `capsule.llm.model`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

# rope types whose rotation at position p is a fixed function of p: a key rotated from 0 to p
# equals the key computed at p. YaRN / dynamic NTK rescale with the sequence length, so no.
REINJECTABLE_ROPE_TYPES = ("default", "llama3")
_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_reinjectable(rope: Any) -> None:
    """Raise UnsupportedArchitecture unless `rope` (a RopeConfig, duck-typed on `rope_type`)
    can have its pre-RoPE keys rotated at serving time with the same result as a prefill."""
    rope_type = getattr(rope, "rope_type", None)
    if rope_type in REINJECTABLE_ROPE_TYPES:
        return
    from capsule.errors import UnsupportedArchitecture  # lazy: keeps edge_kernels import-light
    raise UnsupportedArchitecture(
        f"rope type {rope_type!r} cannot be re-rotated position-independently, so memory facts "
        f"cannot be cached pre-RoPE for this model; supported: {', '.join(REINJECTABLE_ROPE_TYPES)} "
        "(YaRN and dynamic NTK scale depend on the sequence length)")


def rotate_scatter(kv_pool: torch.Tensor, k_pre: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor,
                   cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
    """Rotate pre-RoPE keys to `positions` and write K and V of every layer into `slots`.

    k_pre, v: (L, T, KV, hd), any float dtype, any device; the rest as in rotate_scatter_tokens,
    which this calls with the two stacked token-major (an extra copy that facts kept token-major,
    FactKV.kv, do not pay).
    """
    _check_pool(kv_pool)
    _, L, _, _, KV, hd = kv_pool.shape
    if k_pre.dim() != 4 or k_pre.shape[0] != L or tuple(k_pre.shape[2:]) != (KV, hd):
        raise ValueError(f"k_pre must be (L, T, KV, hd) = ({L}, T, {KV}, {hd}), got {tuple(k_pre.shape)}")
    if tuple(v.shape) != tuple(k_pre.shape):
        raise ValueError(f"v must have k_pre's shape {tuple(k_pre.shape)}, got {tuple(v.shape)}")
    if not (k_pre.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"k_pre and v must be floating point, got {k_pre.dtype}, {v.dtype}")
    dev = kv_pool.device
    tokens = torch.stack((k_pre.to(dev), v.to(dev)), dim=2).transpose(0, 1)   # (T, L, 2, KV, hd)
    rotate_scatter_tokens(kv_pool, [tokens], positions, slots, cos_table, sin_table)


def rotate_scatter_tokens(kv_pool: torch.Tensor, parts: Sequence[torch.Tensor],
                          positions: torch.Tensor, slots: torch.Tensor,
                          cos_table: torch.Tensor, sin_table: torch.Tensor,
                          key_scale: float | torch.Tensor = 1.0) -> None:
    """Concatenate token-major K/V parts, rotate their keys to `positions`, write them to `slots`.

    kv_pool: (NB, L, 2, bs, KV, hd), fp32/fp16/bf16, written in place;
    parts: tensors (T_i, L, 2, KV, hd), [:, :, 0] keys before RoPE and [:, :, 1] values, any
    float dtype, any device (moved to the pool's), never modified; T = sum of T_i;
    positions: (T,) int64 serving positions, each < P; slots: (T,) int64 distinct
    block * bs + offset, each < NB * bs; cos_table, sin_table: fp32 (P, hd), i.e.
    Decoder.rope_cos / rope_sin after prepare_rope. The rotation is computed in fp32 and
    rounded once to the pool dtype (fp32 pools: bit-identical to Decoder.forward's keys).
    key_scale multiplies the keys in fp32 before the rotation (a memory temperature; 1: none):
    one float for every token, or a (T,) fp32 tensor, one per token (e.g. per fact).
    Token-major parts make this one concatenation (a memcpy per part), an in-place rotation
    and one scatter, whatever the number of parts. The caller marks the blocks dirty
    (BlockTable.slots does) and owns slot allocation.
    """
    _check_pool(kv_pool)
    NB, L, _, bs, KV, hd = kv_pool.shape
    parts = list(parts)
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor) or part.dim() != 5 or tuple(part.shape[1:]) != (L, 2, KV, hd):
            got = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
            raise ValueError(f"parts[{i}] must be (T, L, 2, KV, hd) = (T, {L}, 2, {KV}, {hd}), got {got}")
        if not part.is_floating_point():
            raise ValueError(f"parts[{i}] must be floating point, got {part.dtype}")
    T = sum(p.shape[0] for p in parts)
    for name, idx in (("positions", positions), ("slots", slots)):
        if idx.dtype != torch.int64 or tuple(idx.shape) != (T,):
            raise ValueError(f"{name} must be int64 of shape ({T},), got {idx.dtype} {tuple(idx.shape)}")
    if cos_table.dim() != 2 or cos_table.shape[1] != hd or sin_table.shape != cos_table.shape:
        raise ValueError(f"cos/sin tables must both be (P, {hd}), got {tuple(cos_table.shape)} "
                         f"and {tuple(sin_table.shape)}")
    if cos_table.dtype != torch.float32 or sin_table.dtype != torch.float32:
        raise ValueError(f"cos/sin tables must be fp32 (angles in fp32), got {cos_table.dtype}, "
                         f"{sin_table.dtype}")
    if isinstance(key_scale, torch.Tensor) and (key_scale.dtype != torch.float32
                                                or tuple(key_scale.shape) != (T,)):
        raise ValueError(f"key_scale must be a float or an fp32 tensor of shape ({T},), got "
                         f"{key_scale.dtype} {tuple(key_scale.shape)}")
    if T == 0:
        return
    dev = kv_pool.device
    positions, slots = positions.to(dev), slots.to(dev)
    # one host sync checks every index: an out-of-range index on CUDA is a device assert that
    # poisons the whole context, and duplicate slots would make index_put_ nondeterministic
    P = cos_table.shape[0]
    dup = (slots.sort().values.diff() == 0).any()                         # False when T == 1
    run = (slots.diff() == 1).all()                                       # consecutive slots
    pmin, pmax, smin, smax, has_dup, is_run = torch.stack(
        (positions.min(), positions.max(), slots.min(), slots.max(), dup.long(), run.long())).tolist()
    if pmin < 0 or pmax >= P:
        raise ValueError(f"positions must lie in [0, {P}) (the rope table's length), got [{pmin}, {pmax}]; "
                         "call prepare_rope with more positions")
    if smin < 0 or smax >= NB * bs:
        raise ValueError(f"slots must lie in [0, {NB * bs}), got [{smin}, {smax}]")
    if has_dup:
        raise ValueError("slots must be distinct: two tokens cannot share a cache slot")

    buf = torch.cat([p.to(dev) for p in parts])                           # (T, L, 2, KV, hd), ours
    k = buf[:, :, 0].float()              # (T, L, KV, hd) fp32: a view of buf when buf is fp32
    if isinstance(key_scale, torch.Tensor):
        k.mul_(key_scale.to(dev).view(T, 1, 1, 1))   # buf is our concatenation: parts untouched
    elif key_scale != 1.0:
        k.mul_(key_scale)
    _rotate_(k, cos_table.to(dev)[positions].view(T, 1, 1, hd), sin_table.to(dev)[positions].view(T, 1, 1, hd))
    if buf.dtype != kv_pool.dtype or k.data_ptr() != buf.data_ptr():
        out = torch.empty(buf.shape, dtype=kv_pool.dtype, device=dev)
        out[:, :, 0] = k                                                  # rounded once
        out[:, :, 1] = buf[:, :, 1]
        buf = out
    by_token = kv_pool.permute(0, 3, 1, 2, 4, 5)         # (NB, bs, L, 2, KV, hd), same storage
    if is_run:
        _write_run(by_token, buf, smin)
        return
    block = torch.div(slots, bs, rounding_mode="floor")
    offset = slots - block * bs
    by_token.index_put_((block, offset), buf)              # every layer's K and V in one pass


def _write_run(by_token: torch.Tensor, buf: torch.Tensor, first_slot: int) -> None:
    """Write tokens to consecutive slots (so consecutive blocks: a memory region usually gets
    them) as at most three strided copies, not a per-token scatter (~2x faster on CPU)."""
    bs, T = by_token.shape[1], buf.shape[0]
    block, offset = divmod(first_slot, bs)
    t = 0
    if offset:                                              # the rest of a partly used block
        t = min(bs - offset, T)
        by_token[block, offset:offset + t].copy_(buf[:t])
        block += 1
    n = (T - t) // bs
    if n:                                                   # whole blocks
        by_token[block:block + n].copy_(buf[t:t + n * bs].view(n, bs, *buf.shape[1:]))
        t, block = t + n * bs, block + n
    if t < T:                                               # the start of the last one
        by_token[block, :T - t].copy_(buf[t:])


def _rotate_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """k <- k * cos + rotate_half(k) * sin in place, fp32: the same products and sum as the
    Decoder's rotation, so bit-identical. One full-width temporary: on CPU, ops over the
    (strided) halves run short inner loops and cost ~1.5x more."""
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)       # rotate_half(k)
    rotated.mul_(sin)
    k.mul_(cos).add_(rotated)


def _check_pool(kv_pool: torch.Tensor) -> None:
    if kv_pool.dim() != 6:
        raise ValueError(f"kv_pool must be (NB, L, 2, bs, KV, hd), got shape {tuple(kv_pool.shape)}")
    if kv_pool.shape[2] != 2:
        raise ValueError(f"kv_pool dim 2 must be 2 (K, V), got {kv_pool.shape[2]}")
    if kv_pool.dtype not in _POOL_DTYPES:
        raise ValueError(f"kv_pool dtype must be one of {_POOL_DTYPES}, got {kv_pool.dtype}")
