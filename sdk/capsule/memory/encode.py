"""Encode a memory fact once into pre-RoPE K/V, and its small binary format.

A fact's keys are kept BEFORE rotary rotation, so the same encoding is injected at any
serving position (edge_kernels.rope.rotate_scatter rotates them there). With context ids
the fact is encoded after them (a context window), and only the fact's tokens are kept.
"""
from __future__ import annotations

import operator
import struct
import zlib
from typing import Sequence

import numpy as np
import torch

from edge_kernels.rope import check_reinjectable

from ..llm.model import Decoder

MAGIC = b"CPFACTKV"
VERSION = 1
# magic, version, dtype code, L, T, KV, hd, crc32 (of the header before it + the payload)
HEADER = struct.Struct("<8sHHIIIII")
_CRC_AT = HEADER.size - 4
# code -> (torch dtype, same-size int dtype for raw bytes, little-endian numpy int dtype)
_DTYPES: dict[int, tuple[torch.dtype, torch.dtype, str]] = {
    1: (torch.float32, torch.int32, "<i4"),
    2: (torch.float16, torch.int16, "<i2"),
    3: (torch.bfloat16, torch.int16, "<i2"),
}
_CODES = {dt: code for code, (dt, _, _) in _DTYPES.items()}
# code -> bytes per element: what a reader checking only headers (capsule verify) needs
ITEM_BYTES = {code: int(le[-1]) for code, (_, _, le) in _DTYPES.items()}


class FactKV:
    """One fact's per-layer keys (pre-RoPE) and values, CPU tensors in the model dtype.

    Held token-major, kv: (T, L, 2, KV, hd) with [:, :, 0] the keys and [:, :, 1] the values,
    so injecting k facts is one concatenation (a memcpy per fact) however many there are.
    k_pre, v: (L, T, KV, hd) views of it; token t of the fact is k_pre[:, t] / v[:, t].
    """

    __slots__ = ("kv",)

    def __init__(self, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        if not isinstance(k_pre, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError("FactKV holds two torch tensors, k_pre and v")
        if k_pre.dim() != 4 or tuple(k_pre.shape) != tuple(v.shape) or k_pre.shape[1] < 1 \
                or k_pre.numel() == 0:
            raise ValueError(f"k_pre and v must share one non-empty (L, T, KV, hd) shape, got "
                             f"{tuple(k_pre.shape)} and {tuple(v.shape)}")
        if k_pre.dtype != v.dtype or k_pre.dtype not in _CODES:
            raise ValueError(f"k_pre and v must share a dtype among {list(_CODES)}, got {k_pre.dtype}, {v.dtype}")
        if k_pre.device.type != "cpu" or v.device.type != "cpu":
            raise ValueError(f"FactKV tensors live on the CPU, got {k_pre.device} and {v.device}")
        self.kv = torch.stack((k_pre, v), dim=2).transpose(0, 1).contiguous()   # (T, L, 2, KV, hd)

    @classmethod
    def _of_tokens(cls, kv: torch.Tensor) -> "FactKV":
        """Wrap a contiguous (T, L, 2, KV, hd) tensor already checked by the caller."""
        fact = cls.__new__(cls)
        fact.kv = kv
        return fact

    @property
    def k_pre(self) -> torch.Tensor:
        return self.kv[:, :, 0].transpose(0, 1)                               # (L, T, KV, hd)

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, 1].transpose(0, 1)

    @property
    def n_tokens(self) -> int:
        return self.kv.shape[0]

    def to_bytes(self) -> bytes:
        """Header (magic, version, dtype, L, T, KV, hd, crc32) + raw little-endian K then V."""
        L, T, KV, hd = self.k_pre.shape
        code = _CODES[self.k_pre.dtype]
        _, int_dt, le = _DTYPES[code]
        payload = b"".join(t.contiguous().view(int_dt).numpy().astype(le, copy=False).tobytes()
                           for t in (self.k_pre, self.v))
        head = HEADER.pack(MAGIC, VERSION, code, L, T, KV, hd, 0)[:_CRC_AT]
        crc = zlib.crc32(payload, zlib.crc32(head))
        return head + struct.pack("<I", crc) + payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *,
                   expect: tuple[int, int, int, torch.dtype]) -> "FactKV":
        """Parse untrusted bytes; `expect` = (L, KV, hd, dtype) of the model they are for.

        Raises ValueError naming what is wrong (not bytes, truncated, bad magic / version /
        dtype, shape or dtype other than expected, length other than the header implies, crc).
        """
        L, KV, hd, dtype = _check_expect(expect)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"fact KV data must be bytes, got {type(data).__name__}")
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError("fact KV data must be a contiguous buffer")
        mv = mv.cast("B")
        if len(mv) < HEADER.size:
            raise ValueError(f"fact KV data is truncated: {len(mv)} bytes, the header alone is {HEADER.size}")
        magic, version, code, l_, t_, kv_, hd_, crc = HEADER.unpack_from(mv)
        if magic != MAGIC:
            raise ValueError(f"fact KV data has bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ValueError(f"fact KV format version {version} is not supported (this reads {VERSION})")
        if code not in _DTYPES:
            raise ValueError(f"fact KV data has unknown dtype code {code}")
        got_dtype, int_dt, le = _DTYPES[code]
        if (l_, kv_, hd_, got_dtype) != (L, KV, hd, dtype):
            raise ValueError(f"fact KV is (L={l_}, KV={kv_}, hd={hd_}, {got_dtype}); this model expects "
                             f"(L={L}, KV={KV}, hd={hd}, {dtype}): it was encoded for another model")
        if t_ < 1:
            raise ValueError("fact KV data holds no tokens")
        n = L * t_ * KV * hd                               # elements per tensor (Python int: no overflow)
        want = HEADER.size + 2 * n * ITEM_BYTES[code]
        if len(mv) != want:
            raise ValueError(f"fact KV data is {len(mv)} bytes; its header (T={t_}) implies {want}: "
                             f"{'truncated' if len(mv) < want else 'trailing bytes'}")
        payload = mv[HEADER.size:]
        if zlib.crc32(payload, zlib.crc32(mv[:_CRC_AT])) != crc:
            raise ValueError("fact KV data fails its crc32: the bytes are corrupted")

        # K then V on disk, each (L, T, KV, hd): one copy makes them token-major in host byte order
        raw = np.frombuffer(payload, dtype=le, count=2 * n).reshape(2, L, t_, KV, hd)
        native = np.array(raw.transpose(2, 1, 0, 3, 4), dtype=raw.dtype.newbyteorder("="), order="C",
                          copy=True)   # always a copy: writable, never aliasing the caller's buffer
        return cls._of_tokens(torch.from_numpy(native).view(dtype))          # (T, L, 2, KV, hd)


def _check_expect(expect: tuple[int, int, int, torch.dtype]) -> tuple[int, int, int, torch.dtype]:
    try:
        L, KV, hd, dtype = expect
    except (TypeError, ValueError):
        raise ValueError(f"expect must be (L, KV, hd, dtype), got {expect!r}") from None
    for name, value in (("L", L), ("KV", KV), ("hd", hd)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"expect {name} must be a positive int, got {value!r}")
    if dtype not in _CODES:
        raise ValueError(f"expect dtype must be one of {list(_CODES)}, got {dtype!r}")
    return L, KV, hd, dtype


def _token_ids(ids: Sequence[int], vocab_size: int, name: str) -> list[int]:
    try:
        out = [operator.index(i) for i in ids]
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints") from None
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{name} holds {len(bad)} id(s) outside the vocabulary [0, {vocab_size}), "
                         f"e.g. {bad[:3]}")
    return out


def encode_fact(model: Decoder, fact_ids: Sequence[int], context_ids: Sequence[int] = ()) -> FactKV:
    """Pre-RoPE K and V of `fact_ids`, encoded after `context_ids` at positions 0..n-1.

    Runs one eager forward over context + fact into a private one-block pool (the serving
    pool is untouched) and keeps the fact tokens' keys (after k_proj, before RoPE) and values.
    Returns CPU tensors in the model dtype.
    """
    cfg = model.cfg
    check_reinjectable(cfg.rope)
    fact = _token_ids(fact_ids, cfg.vocab_size, "fact_ids")
    ctx = _token_ids(context_ids, cfg.vocab_size, "context_ids")
    if not fact:
        raise ValueError("fact_ids is empty: a fact needs at least one token")
    n, c = len(ctx) + len(fact), len(ctx)
    if n > cfg.max_position:
        raise ValueError(f"context + fact is {n} tokens; the model has {cfg.max_position} positions")
    have = model.rope_cos.shape[0]
    if have == 0:
        model.prepare_rope(n)
    elif have < n:
        # growing the tables would move them under a captured CUDA graph: refuse instead
        raise ValueError(f"context + fact is {n} tokens; the model's rope tables hold {have} positions")
    dev, L, KV, hd = model.device, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    with torch.inference_mode():
        pool = torch.zeros(1, L, 2, n, KV, hd, dtype=model.dtype, device=dev)  # one block of n slots
        ids = torch.tensor([ctx + fact], dtype=torch.long, device=dev)           # (1, n)
        pos = torch.arange(n, dtype=torch.long, device=dev)                      # (n,)
        capture: list = []
        model(ids, pos.view(1, n), pos, torch.zeros(1, 1, dtype=torch.long, device=dev), pool,
              capture=capture)
        k_pre = torch.stack([k[c:] for k, _ in capture]).cpu()                   # (L, T, KV, hd)
        v = torch.stack([vv[c:] for _, vv in capture]).cpu()
    # packed outside inference mode: callers get ordinary tensors, usable anywhere
    return FactKV(k_pre, v)
