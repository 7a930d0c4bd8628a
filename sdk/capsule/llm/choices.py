"""Constrained choice: generation that can only emit one of a few given strings.

``Choices(tokenizer, ["reach", "open", "home"])`` tokenizes each choice on its own (the ids whose
bytes are exactly the choice) into a trie; during decoding every logit outside the trie's
continuations of what was generated so far is -inf, and decoding ends when the ids spell a whole
choice. So the reply is always exactly one choice, picked by the model (greedy: its most likely
path through the trie; sampled: under the stream's own generator, reproducible after a
restore). The next append re-tokenizes the stream's text with the choice in it, as after any
reply (the K/V of the ids that agree is kept).

A choice whose ids begin another's would make "stop here or go on" ambiguous: refused, with a
hint to make them differ (a trailing newline on each, for example).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 256


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def check_choices(choices: object) -> list[str]:
    """The choices as a list, or ValueError saying what to fix."""
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ValueError(f"choices must be a list of strings, got {type(choices).__name__}")
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"choices must hold 1..{MAX_CHOICES} strings, got {len(choices)}")
    for c in choices:
        if not isinstance(c, str) or not 1 <= len(c) <= MAX_CHOICE_CHARS:
            raise ValueError(f"each choice must be a non-empty str of at most {MAX_CHOICE_CHARS} "
                             f"characters, got {c!r}")
    if len(set(choices)) != len(choices):
        raise ValueError(f"choices must be distinct, got {list(choices)}")
    return list(choices)


class Choices:
    """The token trie of a list of choices (see the module docstring)."""

    def __init__(self, tokenizer: _Encoder, choices: Sequence[str]) -> None:
        self.choices = check_choices(list(choices))
        self.ids = {tuple(tokenizer.encode(c)): c for c in self.choices}
        seqs = sorted(self.ids)
        for a, b in zip(seqs, seqs[1:]):      # sorted: a prefix sorts right before its extensions
            if b[:len(a)] == a:
                raise ValueError(f"choice {self.ids[a]!r} is a token prefix of {self.ids[b]!r}: "
                                 "decoding could not tell where to stop; make them differ (e.g. end "
                                 "each with a newline)")
        self.next: dict[tuple[int, ...], list[int]] = {}
        for seq in seqs:
            for i in range(len(seq)):
                nxt = self.next.setdefault(seq[:i], [])
                if seq[i] not in nxt:
                    nxt.append(seq[i])
        self.max_tokens = max(len(s) for s in seqs)

    def mask(self, logits: torch.Tensor, prefix: Sequence[int]) -> None:
        """Set every logit of ``logits`` (V,) that cannot continue ``prefix`` to -inf, in place."""
        allowed = torch.tensor(self.next[tuple(prefix)], dtype=torch.long, device=logits.device)
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    def done(self, prefix: Sequence[int]) -> bool:
        """True when ``prefix`` spells a whole choice."""
        return tuple(prefix) in self.ids
