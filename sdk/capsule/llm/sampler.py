"""Token sampling: greedy, or temperature / top-p with an explicit per-stream generator.

The generator's state is execution state: a seeded stream replays the same tokens, and a
capsule that saves `generator.get_state()` resumes the same sequence after a restore.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest nucleus with that mass."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of logits (n, V). Reads the result back to the host once per step."""
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError("one SamplingParams and one generator per logits row are needed")
    picks = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            picks.append(torch.argmax(row))
            continue
        if gen is None:
            raise ValueError("sampling with temperature > 0 needs a generator (pass seed=)")
        probs = torch.softmax(row.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep a token while the mass before it is below top_p (the top token always stays)
            keep = (sorted_p.cumsum(-1) - sorted_p) < p.top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        picks.append(torch.multinomial(probs, 1, generator=gen)[0])
    return torch.stack(picks).tolist()
