"""The state-region registry: every static buffer a captured graph reads or writes.

This is the small shared vocabulary between the runtime (which allocates the buffers once)
and the checkpointer (which snapshots and restores them in place). Registering a buffer
promises that its storage never moves for the life of the owner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

ROLES = ("kv", "input", "output", "sampling", "policy", "rng")


@dataclass(frozen=True)
class Region:
    """One registered buffer. `role` says what it holds; `page_bytes` how the checkpointer splits it.

    Pages are consecutive byte ranges of `page_bytes`. For role "kv" (the block-major paged
    pool) page i is block i, and which pages changed comes from the pool's write log.
    """

    name: str
    tensor: torch.Tensor
    role: str
    page_bytes: int

    def layout(self) -> dict:
        """What the bytes mean, without the bytes: part of a capsule's binding."""
        return {"name": self.name, "role": self.role, "shape": list(self.tensor.shape),
                "dtype": str(self.tensor.dtype).removeprefix("torch."), "page_bytes": self.page_bytes}


class RegionRegistry:
    """Ordered name -> Region map. Not thread-safe: register at open, read at step boundaries."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}

    def register(self, name: str, tensor: torch.Tensor, role: str, *, page_bytes: int = 4096) -> Region:
        if role not in ROLES:
            raise ValueError(f"region role {role!r} is not one of {', '.join(ROLES)}")
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered")
        if not tensor.is_contiguous():
            raise ValueError(f"region {name!r} must be contiguous so pages map to byte ranges")
        if page_bytes <= 0:
            raise ValueError(f"region {name!r}: page_bytes must be > 0, got {page_bytes}")
        region = Region(name, tensor, role, page_bytes)
        self._regions[name] = region
        return region

    def __getitem__(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"no region {name!r}; registered: {', '.join(self._regions)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._regions

    def __iter__(self) -> Iterator[Region]:
        return iter(self._regions.values())

    def __len__(self) -> int:
        return len(self._regions)

    def names(self) -> list[str]:
        return list(self._regions)

    def layout(self) -> list[dict]:
        return [r.layout() for r in self]

    def data_ptrs(self) -> dict[str, int]:
        """Storage addresses by name: equal before and after a restore, or graphs would break."""
        return {r.name: r.tensor.data_ptr() for r in self}
