"""LLMPart: a Session's language model: the engine (graph runner, paged KV pool, streams), its
tokenizer and its persistent memory.

Not thread-safe: the Session calls it inside its gate's LLM section.
"""
from __future__ import annotations

from typing import Sequence

from .assembly import LLMParts
from .llm import ModelInfo, SamplingParams
from .llm.engine import Engine
from .memory.facts import Memory
from .session_memory import MemoryPart
from .tokenize import ReferenceTokenizer


class LLMPart:
    def __init__(self, parts: LLMParts, memory: Memory):
        self.parts = parts
        self.engine: Engine = parts.engine
        self.tokenizer: ReferenceTokenizer = parts.tokenizer
        self.info: ModelInfo = parts.info
        self.memory = MemoryPart(memory, self.engine, self.tokenizer)

    def append(self, stream: str, text: str, system: bool) -> None:
        self.engine.append(stream, text, system=system)

    def generate(self, names: list[str], max_new_tokens: int, params: SamplingParams,
                 seed: int | None, stops: list[str], memory_k: int) -> dict[str, str]:
        """Every stream's reply; more streams than the largest batch bucket decode in groups."""
        for n in names:
            self.engine.stream(n)   # unknown streams fail before any memory work
        if memory_k:
            self.memory.inject(names, memory_k, max_new_tokens)
        bucket_max = self.engine.runner.buckets[-1]
        replies: dict[str, str] = {}
        for i in range(0, len(names), bucket_max):
            replies.update(self.engine.generate(names[i:i + bucket_max], max_new_tokens, params, seed, stops))
        return replies

    def tokens(self, stream: str) -> list[int]:
        return list(self.engine.stream(stream).ids)

    def text(self, stream: str) -> str:
        return self.engine.stream(stream).text

    def streams(self) -> list[str]:
        return list(self.engine.streams)

    def drop(self, stream: str) -> None:
        self.engine.drop(stream)


def generate_args(max_new_tokens: object, stream: object, temperature: float, top_p: float,
                  seed: object, stop: object, memory_k: object
                  ) -> tuple[list[str], SamplingParams, list[str]]:
    """Session.generate's arguments checked (ValueError saying what to fix): the stream names,
    the sampling parameters and the stop strings."""
    if isinstance(memory_k, bool) or not isinstance(memory_k, int) or memory_k < 0:
        raise ValueError(f"memory_k must be an int >= 0, got {memory_k!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be an int in 0..2**63-1 or None, got {seed!r}")
    params = SamplingParams(float(temperature), float(top_p))
    if not isinstance(stream, (str, list, tuple)):
        raise ValueError(f"stream must be a name or a list of names, got {type(stream).__name__}")
    names = [stream] if isinstance(stream, str) else list(stream)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"stream must be a name or a list of distinct names, got {stream!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or ())   # type: ignore[arg-type]
    if any(not isinstance(x, str) or not x for x in stops):
        raise ValueError(f"stop must be a non-empty str or a list of them, got {stop!r}")
    return names, params, stops
