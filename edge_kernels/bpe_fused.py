"""Fused BPE merges (Triton): each piece merged to completion by one program, no host sync.

Same contract and result as ``edge_kernels.bpe.merge_rows`` (which stays the reference and the
CPU path): rows of byte ids padded with -1 on the right in, each row's final tokens
left-aligned out. The torch loop there launches ~40 operators and syncs the host once per
merge round; here a bucket of rows is one launch, and every round runs in registers.

Pair lookups go through an open-addressing hash table built once per ``MergeTable``
(``HashedTable``): ~1-2 probes instead of the ~18 dependent loads of a binary search.

Rows wider than ``MAX_WIDTH`` bytes (a rare, very long piece) keep the torch loop: one
program's registers hold the whole row. Triton is imported lazily; on CPU the kernel runs only
under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .bpe import NO_RANK, MergeTable, Packed, merge_rows
from .triton_mode import check_runnable

MAX_WIDTH = 2048
TILE = 1024                               # slots per program (rows x width)
INTERPRETER_TILE = 1 << 16
MUL_L, MUL_R = 0x2545F491, 0x3C6EF372     # odd, < 2**30: ids < 2**31 never overflow int64
SHIFTS = tuple(range(0, 30, 2))           # hash bits taken from here; the shift with the
                                          # shortest longest probe wins


@dataclass(frozen=True)
class HashedTable:
    """The pairs of a MergeTable in a linear-probing table; an empty slot has key -1.
    16 bytes a slot, at most 1/4 of the slots used: 16-32 MB for 0.25-0.5M merges."""
    keys: torch.Tensor       # (S,) int64
    values: torch.Tensor     # (S,) int64: rank << 32 | merged id (one load per hit)
    stride: int
    shift: int
    mask: int                # home slot = hash & mask; slots past mask + 1 absorb overflow
    max_probe: int           # longest probe of a present pair (informational)

    @property
    def device(self) -> torch.device:
        return self.keys.device


def _home(left: torch.Tensor, right: torch.Tensor, shift: int, mask: int) -> torch.Tensor:
    return ((left * MUL_L + right * MUL_R) >> shift) & mask


def hash_table(table: MergeTable) -> HashedTable:
    """Builds the probing table on the host (vectorized, no Python loop over pairs), then moves
    it to ``table.device``. Load factor <= 1/4: the longest probe of the four built-in
    vocabularies is then 5-6 slots (<= 1/2: 8-10), the mean ~1.1; every row of a tile waits for
    its slowest lane."""
    if table.stride >= 1 << 31 or (table.ranks.numel() and int(table.ranks.max()) >= 1 << 31):
        raise ValueError(f"the fused BPE takes ids and ranks below 2**31, this vocabulary has "
                         f"{table.stride} ids")
    keys = table.keys.cpu()
    left, right = keys // table.stride, keys % table.stride
    bits = max(4, (4 * max(1, keys.numel()) - 1).bit_length())
    mask = (1 << bits) - 1
    best: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
    for shift in SHIFTS:
        home = _home(left, right, shift, mask)
        order = torch.argsort(home, stable=True)
        h = home[order]
        # linear probing in home order: slot_i = max(home_i, slot_{i-1} + 1)
        #   = i + max_{k <= i}(home_k - k), a running max
        i = torch.arange(h.numel())
        slot = i + torch.cummax(h - i, 0).values if h.numel() else h
        probe = int((slot - h).max()) + 1 if h.numel() else 0
        if best is None or probe < best[1]:
            best = (shift, probe, order, slot)
    shift, probe, order, slot = best  # type: ignore[misc]
    size = max(int(slot.max()) + 1 if slot.numel() else 0, mask + 1) + 1   # >= 1 empty tail slot
    k = torch.full((size,), -1, dtype=torch.int64)
    v = torch.full((size,), -1, dtype=torch.int64)
    k[slot] = keys[order]
    v[slot] = (table.ranks.cpu()[order] << 32) | table.merged.cpu()[order]
    dev = table.device
    return HashedTable(k.to(dev), v.to(dev), table.stride, shift, mask, probe)


def _kernel() -> Callable[..., Any]:
    try:
        from .bpe_fused_kernel import bpe_merge_kernel
    except ImportError as exc:
        raise ImportError("edge_kernels.bpe_fused needs Triton: pip install triton (on CPU, "
                          f"run it with TRITON_INTERPRET=1) ({exc})") from exc
    return bpe_merge_kernel


def merge_rows_fused(ids: torch.Tensor, table: MergeTable, hashed: HashedTable) -> torch.Tensor:
    """``merge_rows(ids, table)`` with one kernel launch: (B, L) int64 rows, -1 padded right."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be (B, L), got {tuple(ids.shape)}")
    B, L = ids.shape
    if B == 0 or L < 2:
        return ids.clone()
    if L > MAX_WIDTH:
        return merge_rows(ids, table)
    if ids.device != hashed.device:
        raise ValueError(f"ids are on {ids.device}, the hash table on {hashed.device}")
    check_runnable(ids.device, "fused BPE kernel")
    src = ids.to(torch.int64).contiguous()
    out = torch.empty_like(src)
    block = max(16, 1 << (L - 1).bit_length())
    # short rows share a program. On CUDA the row count depends on the width alone (one
    # compiled variant per width bucket); the interpreter pays per operation, not per element,
    # so there the whole bucket shares one program (same result, the tests' time)
    if ids.device.type == "cuda":
        rows = max(1, TILE // block)
    else:
        rows = max(1, min(INTERPRETER_TILE // block, 1 << (B - 1).bit_length()))
    _kernel()[(-(-B // rows),)](                 # ceil(B / rows) programs
        src, out, hashed.keys, hashed.values, B, L, hashed.stride, MUL_L, MUL_R,
        hashed.shift, hashed.mask, NO_RANK=NO_RANK, ROWS=rows, LOG=block.bit_length(), BLOCK=block,
        num_warps=max(1, min(8, rows * block // 256)))
    return out


def merge_packed_fused(packed: Packed, table: MergeTable, hashed: HashedTable) -> Packed:
    """merge_rows_fused on every length bucket: one launch each, no host sync in between."""
    return [(members, merge_rows_fused(rows, table, hashed)) for members, rows in packed]
