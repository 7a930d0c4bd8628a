"""The frozen part of a stream: text and ids before the tail, in chunks no edit reaches again.

``IncrementalTokenizer`` keeps piece boundaries only for its tail (the last few KB); when the
tail grows past ``freeze_at`` chars it is cut at a boundary and the part before moves here, so each
append costs what the tail holds, not what the stream holds. Reads (``text_slice``,
``ids_slice``) cost what they return.
"""
from __future__ import annotations

import itertools
from array import array
from bisect import bisect_right
from typing import Callable, Sequence

from .splice import gather


class Frozen:
    """Chunks of text and their ids, back to back from the start of the stream up to the
    tail, which starts at char ``chars`` and token ``tokens``; ``before`` is the char before it
    ("" when nothing is frozen)."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.chunk_ids: list[array] = []
        self.starts: list[int] = []    # char offset of each chunk
        self.counts: list[int] = []    # token count before each chunk
        self.chars = self.tokens = 0
        self.before = ""

    def push(self, text: str, ids: Sequence[int]) -> None:
        """Freeze ``text`` (non-empty) and its ``ids`` after what is frozen already."""
        self.starts.append(self.chars)
        self.counts.append(self.tokens)
        self.chunks.append(text)
        self.chunk_ids.append(ids if isinstance(ids, array) else array("I", ids))
        self.chars += len(text)
        self.tokens += len(ids)
        self.before = text[-1]

    def text_slice(self, tail: str, lo: int, hi: int) -> str:
        """``(frozen + tail)[lo:hi]``."""
        return "".join(gather(self.starts, self.chunks, tail, self.chars, lo, hi))

    def ids_slice(self, tail_ids: Sequence[int], lo: int, hi: int) -> list[int]:
        """``(frozen ids + tail_ids)[lo:hi]``."""
        return list(itertools.chain(*gather(self.counts, self.chunk_ids, tail_ids, self.tokens, lo, hi)))


def freeze_index(bpos: list[int], end: int, keep: int, freeze_at: int,
                 accepted: Callable[[], int | None]) -> int:
    """The boundary (index into ``bpos``, the tail's piece starts) to freeze a tail ending at
    ``end`` at: the first one at most ``keep`` chars from the end, or later while the tail would
    stay over ``freeze_at``, but never past ``accepted()``, the boundary an append at the end would start
    from — freezing at one the splice rule rejects (the start of a long space run) would make
    every later append a full rebuild. 0 or less: freeze nothing."""
    j = bisect_right(bpos, end - keep) - 1
    while j + 1 < len(bpos) and end - bpos[j] > freeze_at:
        j += 1
    if j > 0:
        ok = accepted()
        j = min(j, -1 if ok is None else ok)
    return j
