"""The paged KV pool: one static tensor allocated at open, handed out in fixed-size blocks."""
from __future__ import annotations

import ctypes
import heapq
import mmap
import sys

import torch

from ..errors import CapacityError
from .config import ModelConfig

SCRATCH_BLOCK = 0  # never handed out: padded batch rows write their K/V here
_MADV_HUGEPAGE = 14


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

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"KV pool is full: need {n} more block(s) of {self.block_size} tokens, "
                                f"{len(self._free)} free of {self.num_blocks - 1}; raise runtime.kv_pool_mb "
                                "or shorten the streams")
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        if blocks:
            self.tensor.index_fill_(0, torch.tensor(blocks, device=self.tensor.device), 0)
            self.dirty.update(blocks)  # zeroed content is state too: the next capsule carries it
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)

    def reset_allocation(self, used: set[int]) -> None:
        """Rebuild the free list so that exactly `used` blocks are taken (after a restore)."""
        self._free = [b for b in range(1, self.num_blocks) if b not in used]
        heapq.heapify(self._free)


class BlockTable:
    """One stream's blocks, in position order, and how many of its tokens have K/V cached."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.num_cached = 0

    def ensure_capacity(self, n_tokens: int) -> None:
        need = -(-n_tokens // self.pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.pool.allocate(need))

    def truncate(self, n_tokens: int) -> None:
        """Forget cached tokens from n_tokens on (their blocks go back when wholly unused)."""
        self.num_cached = min(self.num_cached, n_tokens)
        keep = -(-self.num_cached // self.pool.block_size)
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def slots(self, start: int, end: int) -> list[int]:
        """Slot ids of positions start..end-1, which the caller is about to write (marks them dirty)."""
        bs = self.pool.block_size
        self.pool.dirty.update(self.blocks[start // bs: -(-end // bs)])
        return [self.blocks[p // bs] * bs + p % bs for p in range(start, end)]
