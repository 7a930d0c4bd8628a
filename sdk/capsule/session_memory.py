"""MemoryPart: persistent memory of a Session's LLM (remember / forget / recall, and the
injection of facts' K/V into streams' memory regions before a generate). See docs/MEMORY.md.

Not thread-safe: the Session calls it inside its gate's LLM section.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .errors import CapacityError
from .llm.engine import Engine
from .memory.facts import Fact, Memory
from .tokenize import ReferenceTokenizer


class MemoryPart:
    def __init__(self, memory: Memory, engine: Engine, tokenizer: ReferenceTokenizer):
        self.memory = memory
        self._engine = engine
        self._tokenizer = tokenizer

    def remember(self, text: str, tags: Sequence[str] | None, context: str | None) -> int:
        if context is not None and not isinstance(context, str):
            raise ValueError(f"context must be a str (text the fact follows) or None, got "
                             f"{type(context).__name__}")
        mem, ctx = self.memory, []
        if mem.config.window:
            if context is not None:
                ctx = self._tokenizer.encode(context)
            elif "main" in self._engine.streams:   # the window's worth, not the history
                main = self._engine.streams["main"]
                ctx = main.ids_slice(max(0, main.n_ids - mem.config.window))
        return mem.remember(text, tags, ctx)

    def forget(self, fact_id: int) -> None:
        self.memory.forget(fact_id)
        self.drop_forgotten()

    def clear(self, stream: str) -> None:
        if self._engine.stream(stream).region is not None:
            self._engine.fill_memory(stream, [], self.memory.config.region_tokens)

    def recall(self, query: str, k: int) -> list[Fact]:
        return self.memory.recall(query, k)

    def inject(self, names: Sequence[str], memory_k: int, max_new_tokens: int) -> None:
        """Fill each stream's region with its top memory_k facts that are intact and fit.

        Every stream's facts are chosen and checked first: an error leaves every stream as it was.
        """
        mem, engine = self.memory, self._engine
        limit = min(mem.config.region_tokens, engine.pool.capacity_tokens)
        if memory_k > limit:
            raise ValueError(f"memory_k={memory_k} facts cannot fit: a fact takes at least one "
                             f"position and the memory region holds {mem.config.region_tokens} "
                             f"(the KV pool {engine.pool.capacity_tokens}); use memory_k <= {limit}")
        plans, blocks = [], 0
        for name in names:
            room, need = engine.memory_room(name, mem.config.region_tokens, max_new_tokens)
            # blocks one stream frees (truncated to its prefix) are not counted for another: the
            # sum of the positive needs is enough whatever the order the streams are filled in
            blocks += max(0, need)
            s = engine.stream(name)
            plans.append((name, self._choose(s.last_user or s.text_tail(500), memory_k, room)))
        if blocks > engine.pool.free_blocks:
            raise CapacityError(f"KV pool is full: {', '.join(map(repr, names))} with their memory regions "
                                f"and {max_new_tokens} new tokens need {blocks} more block(s), "
                                f"{engine.pool.free_blocks} are free; raise runtime.kv_pool_mb, lower "
                                "MemoryConfig.region_tokens or shorten the streams")
        for name, chosen in plans:
            engine.fill_memory(name, chosen, mem.config.region_tokens, mem.config.key_scales(len(chosen)))

    def drop_forgotten(self) -> None:
        """Refill, without them, every region holding facts that are no longer stored (forgotten;
        e.g. after a restore of an older capsule). While refilling, a remaining fact whose K/V
        is now damaged is left out too (with a warning)."""
        mem, engine = self.memory, self._engine
        for name, s in engine.streams.items():
            if s.region is None or not s.region.facts:
                continue
            ids = s.region.fact_ids
            known = mem.stored(ids)    # damaged ones count (not forgotten): kv() refuses them
            if known == set(ids):
                continue
            kept = [(f, kv.kv) for f in ids if f in known and (kv := mem.kv(f)) is not None]
            engine.fill_memory(name, kept, mem.config.region_tokens, mem.config.key_scales(len(kept)))

    def _choose(self, query: str, k: int, room: int) -> list[tuple[int, torch.Tensor]]:
        """The k best-ranked facts whose K/V is intact and that fit `room` positions, the best
        last (the region's order); a damaged or too long one gives its place to the next one."""
        chosen, used, too_long = [], 0, 0
        for fact in self.memory.recall(query, 2 * k):
            kv = self.memory.kv(fact.id)      # None (with a warning) when its record is damaged
            if kv is None:
                continue
            if used + kv.n_tokens > room:
                too_long += 1
                continue
            chosen.append((fact.id, kv.kv))
            used += kv.n_tokens
            if len(chosen) == k:
                break
        if too_long:
            warnings.warn(f"{too_long} of the best-ranked memory facts did not fit the {room}-position "
                          "memory region and were left out (raise MemoryConfig.region_tokens for a "
                          "new stream, or inject fewer facts)", stacklevel=5)
        # the best-ranked last, right before the conversation: a small model answers from the
        # facts nearest the question far more often (docs/MEMORY.md, "Where facts sit")
        return chosen[::-1]
