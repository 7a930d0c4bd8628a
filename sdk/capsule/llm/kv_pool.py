"""The paged KV pool: one static tensor allocated at open, handed out in fixed-size blocks."""
from __future__ import annotations

import ctypes
import heapq
import mmap
import sys
from typing import Sequence

import torch

from ..errors import CapacityError
from .config import ModelConfig

SCRATCH_BLOCK = 0  # never handed out: padded batch rows write their K/V here
_MADV_HUGEPAGE = 14
# GPU memory a pool must leave free for what is allocated after it: a prefill chunk's
# activations, the decode graphs' memory pool, the sampler, the policy engines' workspaces
POOL_HEADROOM_MIN = 512 * 2**20
POOL_HEADROOM_SHARE = 0.10   # of the device's total memory, when that is more than the minimum


def check_pool_fits(pool_bytes: int, free_bytes: int, total_bytes: int) -> None:
    """CapacityError unless a KV pool of `pool_bytes` fits into the device's *free* memory
    (torch.cuda.mem_get_info: after the weights and other processes), with headroom. A
    profile's nominal memory says nothing about what this process can still allocate."""
    headroom = max(POOL_HEADROOM_MIN, int(POOL_HEADROOM_SHARE * total_bytes))
    if pool_bytes + headroom <= free_bytes:
        return
    mib = 2**20
    fits = max(free_bytes - headroom, 0) // mib
    fix = (f"set runtime.kv_pool_mb to at most {fits}" if fits else
           "free GPU memory (other processes hold it) or open with device='cpu'")
    raise CapacityError(f"KV pool of {pool_bytes / mib:.0f} MiB does not fit on this GPU: {free_bytes / mib:.0f} "
                        f"MiB free of {total_bytes / mib:.0f} MiB (after the weights and other processes), "
                        f"and {headroom / mib:.0f} MiB must stay free for activations and graphs; {fix}")


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under a large host tensor (best effort).

    A restore writes the pool's blocks into fresh memory: with 2 MiB pages that is a few
    hundred page faults instead of tens of thousands, and attention gathers miss the TLB less.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        return end > start and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                            _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class KVPool:
    """K and V of every layer for `num_blocks` blocks of `block_size` tokens.

    tensor: (num_blocks, L, 2, block_size, KV, hd), block-major: a block is one contiguous
    byte range, so a checkpoint page is a plain slice and a restore one memcpy per block.
    Allocated once; its storage never changes, so captured graphs and restores can rely on it.
    """

    def __init__(self, cfg: ModelConfig, *, pool_bytes: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        elem = torch.empty(0, dtype=dtype).element_size()
        block_bytes = cfg.kv_bytes_per_token * block_size * elem
        num_blocks = int(pool_bytes // block_bytes)
        if num_blocks < 2:
            raise CapacityError(f"KV pool of {pool_bytes} bytes holds {num_blocks} block(s) of "
                                f"{block_bytes} bytes; raise runtime.kv_pool_mb to at least "
                                f"{2 * block_bytes / 2**20:.2f}")
        if torch.device(device).type == "cuda":   # before allocating: a clear error, not a CUDA OOM
            check_pool_fits(num_blocks * block_bytes, *torch.cuda.mem_get_info(device))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        # not zeroed as a whole: opening stays O(1) in the pool size. A block is zeroed when it is
        # handed out (attention multiplies masked slots by 0, and 0 * NaN-garbage would be NaN)
        self.tensor = torch.empty(num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype=dtype, device=device)
        if self.tensor.device.type == "cpu":
            advise_hugepages(self.tensor)
        self.tensor[SCRATCH_BLOCK].zero_()
        # which slots attention may read: all of a handed-out block, except the holes a memory
        # region leaves (see memory/layout.py). Derived state: rebuilt from streams on restore
        self.slot_valid = torch.ones(num_blocks, block_size, dtype=torch.bool, device=device)
        self._free = list(range(1, num_blocks))  # a heap: lowest id first, so runs are reproducible
        # blocks written since the last checkpoint: KV is append-only per stream, so the
        # checkpointer learns the delta from here instead of scanning the pool
        self.dirty: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def allocate(self, n: int, *, zero: bool = True) -> list[int]:
        """n free blocks, zeroed unless zero=False (the caller then writes or zeroes each before
        anything reads it: see region.reserve)."""
        if n > len(self._free):
            raise CapacityError(f"KV pool is full: need {n} more block(s) of {self.block_size} tokens, "
                                f"{len(self._free)} free of {self.num_blocks - 1}; raise runtime.kv_pool_mb "
                                "or shorten the streams")
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        if blocks:
            idx = torch.tensor(blocks, device=self.tensor.device)
            if zero:
                self.tensor.index_fill_(0, idx, 0)
            self.slot_valid.index_fill_(0, idx, True)
            self.dirty.update(blocks)  # zeroed content is state too: the next capsule carries it
        return blocks

    def zero(self, blocks: list[int]) -> None:
        if blocks:
            self.tensor.index_fill_(0, torch.tensor(blocks, device=self.tensor.device), 0)
            self.dirty.update(blocks)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)

    def reset_allocation(self, used: set[int]) -> None:
        """Rebuild the free list so that exactly `used` blocks are taken (after a restore)."""
        self._free = [b for b in range(1, self.num_blocks) if b not in used]
        heapq.heapify(self._free)


class BlockTable:
    """One stream's blocks, in position order, and how many of its tokens have K/V cached.

    Token i sits at position i, except after a memory region was reserved (``reserve_gap``):
    tokens from ``gap_at`` on sit ``gap`` positions later, and the first ``pinned`` blocks
    (the prefix and the region) are never released by ``truncate``.
    """

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.num_cached = 0
        self.gap_at = 0
        self.gap = 0
        self.pinned = 0
        self.skip = (0, 0)   # block indices [lo, hi) holding no readable slot: prefill skips them

    def position(self, token: int) -> int:
        """Position (RoPE angle and slot) of token index ``token``."""
        return token + self.gap if self.gap and token >= self.gap_at else token

    def positions(self, start: int, end: int) -> list[int]:
        return [self.position(t) for t in range(start, end)]

    def slot_end(self, n_tokens: int) -> int:
        """Positions that n_tokens tokens span (what max_context bounds)."""
        return self.position(n_tokens - 1) + 1 if n_tokens > 0 else 0

    def reserve_gap(self, gap_at: int, gap: int, pinned: int, *, zero: bool = True) -> int:
        """Tokens from gap_at on move `gap` positions later; the first `pinned` blocks stay.
        Returns the index of the first block allocated here (blocks from it on are new, and not
        zeroed when zero=False)."""
        if self.num_cached > gap_at:
            raise ValueError("truncate the cached tokens to gap_at before reserving a gap there")
        first_new = len(self.blocks)
        need = pinned - first_new
        if need > 0:   # allocate first: a full pool leaves the table as it was
            self.blocks.extend(self.pool.allocate(need, zero=zero))
        self.gap_at, self.gap, self.pinned = gap_at, gap, pinned
        return first_new

    def ensure_capacity(self, n_tokens: int) -> None:
        need = -(-self.slot_end(n_tokens) // self.pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.pool.allocate(need))

    def truncate(self, n_tokens: int) -> None:
        """Forget cached tokens from n_tokens on (their blocks go back when wholly unused)."""
        self.num_cached = min(self.num_cached, n_tokens)
        keep = max(-(-self.slot_end(self.num_cached) // self.pool.block_size), self.pinned)
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def slots(self, start: int, end: int) -> list[int]:
        """Slot ids of tokens start..end-1, which the caller is about to write (marks them dirty)."""
        return self.slots_at(self.positions(start, end))

    def slots_at(self, positions: list[int]) -> list[int]:
        """Slot ids of positions (marks their blocks dirty: the caller writes them)."""
        bs = self.pool.block_size
        self.pool.dirty.update(self.blocks[p // bs] for p in positions)
        return [self.blocks[p // bs] * bs + p % bs for p in positions]

    def slot_range(self, start: int, end: int) -> torch.Tensor:
        """Slot ids of positions start..end-1 as an int64 tensor on the pool's device, computed
        per block rather than per position (marks their blocks dirty: the caller writes them)."""
        bs, dev = self.pool.block_size, self.pool.tensor.device
        first, last = start // bs, -(-end // bs)
        blocks = self.blocks[first:last]
        self.pool.dirty.update(blocks)
        per_block = torch.tensor(blocks, dtype=torch.long, device=dev).view(-1, 1) * bs
        slots = (per_block + torch.arange(bs, device=dev)).view(-1)              # (n_blocks * bs,)
        return slots[start - first * bs:end - first * bs]

    def attended(self, n_blocks: int) -> tuple[list[int], list[int] | None]:
        """(blocks, their indices) of the first n_blocks minus the skipped ones; indices None
        when nothing is skipped (attention then takes slot s as position s)."""
        return attended_blocks(self.blocks, self.skip, n_blocks)

    def set_valid(self, start: int, end: int, valid: bool) -> None:
        """Mark positions start..end-1 readable (or not) by attention."""
        if end <= start:
            return
        bs, dev = self.pool.block_size, self.pool.slot_valid.device
        pos = torch.arange(start, end, device=dev)
        blocks = torch.tensor(self.blocks, dtype=torch.long, device=dev)[pos // bs]
        self.pool.slot_valid[blocks, pos % bs] = valid


def attended_blocks(blocks: Sequence[int], skip: tuple[int, int],
                    n_blocks: int) -> tuple[list[int], list[int] | None]:
    """The first n_blocks of `blocks` minus block indices [skip[0], skip[1]) (a memory
    region's wholly empty blocks), and the indices kept; indices None when none is left out."""
    lo, hi = skip
    if hi <= lo or lo >= n_blocks:
        return list(blocks[:n_blocks]), None
    idx = [j for j in range(n_blocks) if not lo <= j < hi]
    return [blocks[j] for j in idx], idx
