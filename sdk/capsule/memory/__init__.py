"""Persistent memory as reusable KV: facts encoded once (pre-RoPE), injected at serving positions.

See docs/MEMORY.md. ``Session.open(..., memory=MemoryConfig(...))`` configures it. The names
load lazily: the fact table (facttable.py) is usable without torch (the store's crash trials).
"""
from __future__ import annotations

from typing import Any

__all__ = ["Fact", "Memory", "MemoryConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import facts
        return getattr(facts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
