"""Session methods for persistent memory (remember / forget / recall, injection before generate).

Mixed into Session: they use its lock, engine and Memory. See docs/MEMORY.md.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

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
        with self._llm_section():
            mem = self._mem()
            ctx: list[int] = []
            if mem.config.window:
                if context is not None:
                    ctx = self.tokenizer.encode(context)
                elif "main" in self._llm().streams:
                    ctx = self._llm().streams["main"].ids
            return mem.remember(text, tags, ctx)

    def forget(self, fact_id: int) -> None:
        """Delete a fact (durable when it returns); streams drop it at their next memory_k."""
        with self._llm_section():
            self._mem().forget(fact_id)

    def recall(self, query: str, k: int = 8) -> list[Fact]:
        """The k facts most relevant to query (BM25, fused with MiniLM cosine when installed)."""
        with self._llm_section():
            return self._mem().recall(query, k)

    def _inject(self, names: Sequence[str], memory_k: int) -> None:
        mem, engine = self._mem(), self._llm()
        limit = min(mem.config.region_tokens, engine.pool.capacity_tokens)
        if memory_k > limit:
            raise ValueError(f"memory_k={memory_k} facts cannot fit: the memory region holds "
                             f"{mem.config.region_tokens} tokens and the KV pool "
                             f"{engine.pool.capacity_tokens}; use memory_k <= {limit}")
        for name in names:
            s = engine.stream(name)
            query = s.last_user or s.text[-500:]   # saved in the stream's capsule state
            chosen = []
            for fact in mem.recall(query, memory_k):
                kv = mem.kv(fact.id)
                if kv is not None:
                    chosen.append((fact.id, kv.kv))
            engine.fill_memory(name, chosen, mem.config.region_tokens)

    def _mem(self) -> Memory:
        self._check_open()
        if self._memory is None:
            raise ValueError("this Session has no model (opened with model=None): memory needs one")
        return self._memory
