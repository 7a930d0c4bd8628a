"""Persistent memory as reusable KV: facts encoded once (pre-RoPE), injected at serving positions.

See docs/MEMORY.md. ``Session.open(..., memory=MemoryConfig(...))`` configures it.
"""
from .facts import Fact, Memory, MemoryConfig

__all__ = ["Fact", "Memory", "MemoryConfig"]
