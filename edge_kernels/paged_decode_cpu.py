"""Paged decode attention (T=1) on the CPU in C: each row reads its live K/V in place, once.

Semantics are `paged_decode.paged_decode_attention`'s (GQA, slots 0..seq_lens[b]-1 of the row's
table minus the holes `slot_valid` marks, fp32 softmax scaled by `scale`). Why: the torch path
(`capsule.llm.paged_attention`) copies every block of each row's table per layer, then SDPA
reads the copy; at batch 4 and 2,048 tokens that was ~70 % of a decode step here. The kernel
(csrc/paged_decode_cpu.c) reads each key and each value row once, in a fixed summation order,
so a row's result does not depend on the batch or the thread count.

It is built by `pip install` (setup.py: an optional C extension, no Python API, loaded with
ctypes by cpu_library.py). Where it could not be built (no C compiler), `missing()` says so and
callers keep the torch path. fp32 models; fp32 or bf16 pools (runtime.kv_dtype unset or "bfloat16": bf16 K/V
halve the bytes each step reads); head size a multiple of 16, at most 256.

Hot path: no host sync beyond what eager CPU code does anyway; the output is the one allocation.
"""
from __future__ import annotations

import torch

from . import cpu_library
from .paged_decode import decode_args

MAX_HEADS, LANES, MAX_HEAD_DIM = cpu_library.MAX_HEADS, cpu_library.LANES, cpu_library.MAX_HEAD_DIM  # the kernel's limits
KV_DTYPES = (torch.float32, torch.bfloat16)   # pools it reads (bf16 widens exactly to fp32)


def missing() -> str | None:
    """Why the kernel cannot run here, or None."""
    return cpu_library.missing()


def kernel_threads() -> int:
    """Workers for a kernel called between torch's operators: torch's intra-op thread count when
    the kernels run on its OpenMP team (cpu_library.shares_openmp), else 1: threads of their own
    would compete with its spinning workers (see DecodePlan)."""
    return torch.get_num_threads() if cpu_library.shares_openmp() else 1


def unsupported(k_cache: torch.Tensor, head_dim: int, heads: int,
                dtype: torch.dtype = torch.float32) -> str | None:
    """Why a pool / model is outside the kernel (fp32 or bf16 CPU pool, fp32 queries (``dtype``,
    the model's), head size % 16, at most 256 query heads), or None."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in KV_DTYPES:
        return f"it reads fp32 or bf16 CPU pools, this one is {k_cache.dtype} on {k_cache.device}"
    if dtype != torch.float32:
        return f"it computes in fp32, the model in {dtype}"
    if head_dim % LANES or head_dim > MAX_HEAD_DIM or heads > MAX_HEADS:
        return f"it needs a head size that is a multiple of {LANES} up to {MAX_HEAD_DIM} (got " \
               f"{head_dim}) and at most {MAX_HEADS} query heads (got {heads})"
    return missing()


class DecodePlan:
    """One decode step's rows, checked once for every layer: block tables, lengths, holes.

    block_tables: (B, nb) int; seq_lens: (B,) int, 1 <= seq_lens <= nb * bs; slot_valid: the
    pool's (NB, bs) bool mask, or None; num_blocks / block_size: the pool's NB and bs (a power
    of two). ValueError when a block id or a length would read outside the pool. With
    ``slots`` (B,) (each row's new slot, block * bs + offset) and ``rope`` ((B, hd) cos and sin
    at each row's position), ``layer`` also rotates q and k and writes the new K/V.

    threads: the kernel's workers (1 by default; a decoder passes kernel_threads()). They run on
    torch's OpenMP team where cpu_library found it, else on pthreads started per call; those
    compete with the team's spinning workers (SmolLM2 int4 at torch's 2 threads, batch 1 at
    2,048 tokens: 47.3 ms per token with 2 kernel pthreads, 31.9 with 1; torch's attention 40.2),
    hence 1 there. A row's result does not depend on the count."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 slot_valid: torch.Tensor | None, num_blocks: int, block_size: int, *,
                 slots: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None, threads: int = 1) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"the block size must be a power of two, got {block_size}")
        self.tables = block_tables.to(torch.int64).contiguous()                # (B, nb)
        self.lens = seq_lens.to(torch.int64).contiguous()                       # (B,)
        B, nb = self.tables.shape
        # the kernel trusts these: a bad id or length would read outside the pool
        if B and (int(self.tables.min()) < 0 or int(self.tables.max()) >= num_blocks):
            raise ValueError(f"block_tables hold ids outside the pool's 0..{num_blocks - 1}")
        if B and (int(self.lens.min()) < 1 or int(self.lens.max()) > nb * block_size):
            raise ValueError(f"seq_lens must lie in 1..{nb * block_size} (the table's slots), got "
                             f"{int(self.lens.min())}..{int(self.lens.max())}")
        self.valid = None if slot_valid is None else slot_valid.contiguous().view(torch.uint8)
        self.block_size, self.threads, self.num_blocks = block_size, threads, num_blocks
        self.slots = self.cos = self.sin = None
        if slots is not None and rope is not None:
            self.slots = slots.to(torch.int64).contiguous()                    # (B,)
            if self.slots.shape != (B,) or (B and (int(self.slots.min()) < 0
                                                   or int(self.slots.max()) >= num_blocks * block_size)):
                raise ValueError(f"slots must be {B} slot ids in 0..{num_blocks * block_size - 1}")
            self.cos, self.sin = (t.to(torch.float32).contiguous() for t in rope)   # (B, hd) each

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q (B, H, hd) fp32 contiguous, k_cache / v_cache one layer's (NB, bs, KV, hd) views
        (checked by the caller: paged_decode_attention_cpu, or once per model by the Session)."""
        B, H, hd = q.shape
        KV = k_cache.shape[2]
        out = torch.empty_like(q)                                               # (B, H, hd)
        rc = cpu_library.library().capsule_paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16,
            k_cache.stride(0), KV * hd, hd,
            self.tables.data_ptr(), self.tables.shape[1], self.lens.data_ptr(),
            None if self.valid is None else self.valid.data_ptr(),
            B, H, KV, hd, self.block_size, float(scale), out.data_ptr(), self.threads)
        if rc != 0:
            raise RuntimeError("the CPU paged decode kernel could not allocate its scratch or threads")
        return out


    def layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """A layer's decode attention from its projections, in one C call: RoPE on q (B, H, hd)
        and k (B, KV, hd), k and v (B, KV, hd) written to the plan's slots (rounded to the
        pool's dtype), then attention as __call__. Bit-identical to rope.apply_rope +
        paged_attention.write_kv + __call__. q, k, v: fp32, each row's heads contiguous (views
        of a fused projection are fine); the caches as __call__ takes them."""
        if self.slots is None or self.cos is None or self.sin is None:
            raise ValueError("this DecodePlan was built without slots and rope tables")
        B, H, hd = q.shape
        KV = k.shape[1]
        for name, t, heads in (("q", q, H), ("k", k, KV), ("v", v, KV)):
            if (t.shape != (B, heads, hd) or t.dtype != torch.float32
                    or t.stride()[1:] != (hd, 1) or self.cos.shape != (B, hd)):
                raise ValueError(f"{name} must be fp32 ({B}, {heads}, {hd}) with contiguous heads "
                                 f"(and cos / sin ({B}, {hd})), got {tuple(t.shape)} {t.dtype} "
                                 f"strides {t.stride()}")
        out = torch.empty_like(q, memory_format=torch.contiguous_format)        # (B, H, hd)
        rc = cpu_library.library().capsule_decode_layer(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            self.cos.data_ptr(), self.sin.data_ptr(), self.slots.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16,
            k_cache.stride(0), KV * hd, hd,
            self.tables.data_ptr(), self.tables.shape[1], self.lens.data_ptr(),
            None if self.valid is None else self.valid.data_ptr(),
            B, H, KV, hd, self.block_size, float(scale), out.data_ptr(), self.threads)
        if rc != 0:
            raise RuntimeError("the CPU paged decode kernel could not allocate its scratch or threads")
        return out


def check_layer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError / RuntimeError unless the kernel can read this layer (q already (B, H, hd))."""
    H, hd, KV = q.shape[1], q.shape[2], k_cache.shape[2]
    why = unsupported(k_cache, hd, H)
    if why:
        raise RuntimeError(f"the CPU paged decode kernel cannot run: {why}")
    if q.dtype != torch.float32 or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q must be fp32 and v_cache of k_cache's dtype, got {q.dtype}, "
                         f"{k_cache.dtype} / {v_cache.dtype}")
    if k_cache.stride()[1:] != (KV * hd, hd, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k/v caches need (KV, hd) contiguous per slot and one layout, got strides "
                         f"{k_cache.stride()} / {v_cache.stride()}")


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               slot_valid: torch.Tensor | None = None, *,
                               threads: int = 1) -> torch.Tensor:
    """Decode attention of one query per row over its live key slots, in C.

    q: (B, H, hd) or (B, 1, H, hd) fp32; k_cache, v_cache: (NB, bs, KV, hd) fp32 or bf16 views of one
    layer of the pool (any block stride; each slot's (KV, hd) contiguous, as the pool's are);
    block_tables, seq_lens, slot_valid, threads: as DecodePlan takes them (which checks the block
    size too); each row runs on one thread (each (row, kv head) when there are fewer rows than
    threads). Returns q's shape. ValueError on bad arguments, RuntimeError when the kernel is
    missing or could not get memory. A decoder builds one DecodePlan per step instead."""
    squeeze, q = decode_args(q, k_cache, v_cache, block_tables, seq_lens, slot_valid)
    check_layer(q, k_cache, v_cache)
    plan = DecodePlan(block_tables, seq_lens, slot_valid, k_cache.shape[0], k_cache.shape[1],
                      threads=threads)
    out = plan(q.contiguous(), k_cache, v_cache, scale)
    return out.unsqueeze(1) if squeeze else out
