"""Session methods for persistent memory (remember / forget / recall, injection before generate).

Mixed into Session: they use its lock, engine and Memory. See docs/MEMORY.md.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Sequence

from .errors import CapacityError
from .llm.engine import Engine
from .memory.facts import Fact, Memory
from .tokenize import ReferenceTokenizer


class MemoryMethods:
    _lock: threading.RLock
    _memory: Memory | None
    tokenizer: ReferenceTokenizer | None

    def _llm_section(self) -> Any:   # provided by CapsuleMethods
        raise NotImplementedError

    def _llm(self) -> Engine:   # provided by Session
        raise NotImplementedError

    def _check_open(self) -> None:   # provided by Session
        raise NotImplementedError

    def remember(self, text: str, *, tags: Sequence[str] | None = None,
                 context: str | None = None) -> int:
        """Store a fact durably, its K/V computed once (keys before RoPE); returns its id.

        context: text the fact is encoded after (its last MemoryConfig.window tokens); default:
        the "main" stream's text, when a window is configured.
        """
        if context is not None and not isinstance(context, str):
            raise ValueError(f"context must be a str (text the fact follows) or None, got "
                             f"{type(context).__name__}")
        with self._llm_section():
            mem = self._mem()
            ctx: list[int] = []
            if mem.config.window:
                if context is not None:
                    ctx = self.tokenizer.encode(context)
                elif "main" in self._llm().streams:   # the window's worth, not the history
                    main = self._llm().streams["main"]
                    ctx = main.ids_slice(max(0, main.n_ids - mem.config.window))
            return mem.remember(text, tags, ctx)

    def forget(self, fact_id: int) -> None:
        """Delete a fact (durable when it returns) and drop it from every stream's memory region
        at once (the other facts stay). Capsules taken before still hold its K/V bytes until
        retention drops them; restoring one drops the fact again (see _drop_forgotten)."""
        with self._llm_section():
            self._mem().forget(fact_id)
            self._drop_forgotten()

    def clear_memory(self, stream: str = "main") -> None:
        """Empty a stream's memory region: no fact is attended until its next memory_k."""
        with self._llm_section():
            engine = self._llm()
            if engine.stream(stream).region is not None:
                engine.fill_memory(stream, [], self._mem().config.region_tokens)

    def recall(self, query: str, k: int = 8) -> list[Fact]:
        """The k facts most relevant to query (BM25, fused with MiniLM cosine when installed)."""
        with self._llm_section():
            return self._mem().recall(query, k)

    def _inject(self, names: Sequence[str], memory_k: int, max_new_tokens: int) -> None:
        """Fill each stream's region with its top memory_k facts that are intact and fit.

        Every stream's facts are chosen and checked first: an error leaves every stream as it was.
        """
        mem, engine = self._mem(), self._llm()
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
            plans.append((name, self._choose(mem, s.last_user or s.text_tail(500), memory_k, room)))
        if blocks > engine.pool.free_blocks:
            raise CapacityError(f"KV pool is full: {', '.join(map(repr, names))} with their memory regions "
                                f"and {max_new_tokens} new tokens need {blocks} more block(s), "
                                f"{engine.pool.free_blocks} are free; raise runtime.kv_pool_mb, lower "
                                "MemoryConfig.region_tokens or shorten the streams")
        for name, chosen in plans:
            engine.fill_memory(name, chosen, mem.config.region_tokens)

    def _drop_forgotten(self) -> None:
        """Refill, without them, every region holding facts that are no longer stored (forgotten;
        e.g. after a restore of an older capsule). While refilling, a remaining fact whose K/V
        is now damaged is left out too (with a warning)."""
        if self._memory is None:    # a Memory exists only with a model (and so an engine)
            return
        mem, engine = self._memory, self._llm()
        for name, s in engine.streams.items():
            if s.region is None or not s.region.facts:
                continue
            ids = s.region.fact_ids
            known = {info.id for info in mem.store.facts(ids)}
            if known == set(ids):
                continue
            kept = [(f, kv.kv) for f in ids if f in known and (kv := mem.kv(f)) is not None]
            engine.fill_memory(name, kept, mem.config.region_tokens)

    @staticmethod
    def _choose(mem: Memory, query: str, k: int, room: int) -> list[tuple[int, Any]]:
        """The k best-ranked facts whose K/V is intact and that fit `room` positions, in rank
        order; a damaged or too long one gives its place to the next candidate."""
        chosen, used, too_long = [], 0, 0
        for fact in mem.recall(query, 2 * k):
            kv = mem.kv(fact.id)              # None (with a warning) when its record is damaged
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
                          "new stream, or inject fewer facts)", stacklevel=4)
        return chosen

    def _mem(self) -> Memory:
        self._check_open()
        if self._memory is None:
            raise ValueError("this Session has no model (opened with model=None): memory needs one")
        return self._memory
