"""MemoryConfig: a Session's memory settings (region, encoding window, retrieval, injection)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class MemoryConfig:
    """region_tokens: positions a stream reserves for injected facts (on its first memory_k);
    window: tokens of preceding conversation a fact is encoded after (0: none);
    max_fact_tokens: longest fact accepted; embedder: "auto" | "minilm" | a folder | None;
    cache_facts: decoded facts kept in host memory;
    temperature: attention temperature over injected facts (their keys are scaled by
    1 / temperature when injected; < 1 sharpens, as APE does for contexts encoded apart);
    rank_decay: the keys of the fact ranked r-th by recall (0: the best) are scaled by a
    further 1 / (1 + rank_decay * r), so attention leans on the better-ranked facts (0: all
    alike). docs/MEMORY.md, "Where facts sit, the temperature and the rank decay", has the
    measurements."""
    region_tokens: int = 512
    window: int = 0
    max_fact_tokens: int = 256
    embedder: str | None = "auto"
    cache_facts: int = 256
    temperature: float = 1.0
    rank_decay: float = 0.0

    def __post_init__(self) -> None:
        for name, lo in (("region_tokens", 1), ("window", 0), ("max_fact_tokens", 1),
                         ("cache_facts", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"MemoryConfig.{name} must be an int >= {lo}, got {v!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.05 <= t <= 20:
            raise ValueError(f"MemoryConfig.temperature must be a number in [0.05, 20], got {t!r}")
        d = self.rank_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 10:
            raise ValueError(f"MemoryConfig.rank_decay must be a number in [0, 10], got {d!r}")
        if self.max_fact_tokens > self.region_tokens:
            raise ValueError(f"MemoryConfig.max_fact_tokens ({self.max_fact_tokens}) exceeds region_tokens "
                             f"({self.region_tokens}): a fact that long could never be injected; lower "
                             "max_fact_tokens or raise region_tokens")
        if self.embedder is not None and not isinstance(self.embedder, str):
            raise ValueError(f"MemoryConfig.embedder must be 'auto', 'minilm', a folder path or None, "
                             f"got {self.embedder!r}")

    @property
    def key_scale(self) -> float:
        """What injection multiplies the facts' keys by: 1 / temperature."""
        return 1.0 / self.temperature

    def key_scales(self, n: int) -> tuple[float, ...]:
        """Key scales of n injected facts in the region's order (the best-ranked last, rank 0):
        1 / (temperature * (1 + rank_decay * rank))."""
        return tuple(self.key_scale / (1.0 + self.rank_decay * (n - 1 - j)) for j in range(n))

    @classmethod
    def of(cls, value: "MemoryConfig | Mapping[str, Any] | None") -> "MemoryConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            bad = sorted(set(value) - known)
            if bad:
                raise ValueError(f"unknown memory settings {bad}; allowed: {sorted(known)}")
            return cls(**dict(value))
        raise ValueError(f"memory must be a MemoryConfig, a dict or None, got {type(value).__name__}")
