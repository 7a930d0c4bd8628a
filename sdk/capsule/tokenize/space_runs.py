"""Long runs of one space or tab char (and, under GPT-2's pattern, a long trailing run of ASCII
digits), cut short before pre-tokenizing and put back after.

A whitespace tail of 512 KiB costs the pre-tokenizer one pass over every char of it on every
append (5-15 ns per char for a tiktoken-style regex, 100-200 for the tokenizers library's
multi-stage pipelines). docs/TOKENIZATION.md ("Space runs") proves, for every verified pipeline
whose ``Verified.space_runs`` is set, that the pieces of ``A + c*n + B`` (``c`` a space or a tab,
``n >= KEEP``) are the pieces of ``A + c*KEEP + B`` with every end past the kept run's first
chars moved on by ``n - KEEP``: no piece ends inside the run except next to its two ends; and
the same for a digit run ``D`` (``Verified.digit_runs``: GPT-2's `` ?\p{N}+`` takes it whole),
kept as ``D[0]*KEEP``. An end the proofs rule out sends the caller to the uncut text (``uncut``
returns None). Only the text's last digit run is looked for: it is where a giant digit tail
grows, and a backward match finds it in O(run) (~0.6 ns/char), where a forward regex over
ordinary text costs ~20 ns/char.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KEEP = 16        # chars a cut run keeps: the proof needs 2 at its start and 2 at its end, and a
#                  pipeline stage may take the run's last char off (DeepSeek-LLM has 6 stages)
HEAD = 2         # a kept end at most this far into a run lies next to its start
TAIL = 8         # ... at most this far before its end: next to its end
RUN_MIN = 256    # shorter runs cost less to scan than to cut
_ONE = {c: re.compile(re.escape(c) + "+") for c in " \t"}
try:   # declared dependency; the rules that allow digit runs exist only with it (rules.py)
    import regex
    _TRAIL = regex.compile(r"(?r)[0-9]+\Z")   # matched backwards from the end: O(the run)
except ImportError:   # pragma: no cover
    _TRAIL = None


@dataclass(frozen=True)
class Cut:
    """``text`` with every run of ``RUN_MIN`` or more spaces (or tabs, or its trailing digit
    run) cut to ``KEEP`` chars; ``runs``: (start of the kept run in ``text``, chars removed
    before it, chars removed up to its end)."""
    text: str
    runs: tuple[tuple[int, int, int], ...]


def cut(seg: str, spaces: bool = True, digits: bool = False) -> Cut | None:
    """``seg`` with its long space and tab runs (``spaces``) and its long trailing ASCII digit
    run (``digits``) cut short, or None when it has none."""
    if len(seg) < RUN_MIN:
        return None
    found = _space_runs(seg) if spaces else []
    if digits and _TRAIL is not None and seg[-1:].isdigit():
        m = _TRAIL.search(seg)
        if m is not None and len(seg) - m.start() >= RUN_MIN:
            found.append((m.start(), len(seg)))
    if not found:
        return None
    parts: list[str] = []
    runs: list[tuple[int, int, int]] = []
    at = removed = 0
    for u, v in found:
        parts += (seg[at:u], seg[u] * KEEP)
        runs.append((u - removed, removed, removed + (v - u - KEEP)))
        removed += v - u - KEEP
        at = v
    parts.append(seg[at:])
    return Cut("".join(parts), tuple(runs))


def _space_runs(seg: str) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of RUN_MIN or more spaces, or of tabs, in order: the
    leftmost occurrence of RUN_MIN of them starts a maximal run (substring search, C speed)."""
    out: list[tuple[int, int]] = []
    for c, one in _ONE.items():
        key = c * RUN_MIN
        i = seg.find(key)
        while i >= 0:
            j = one.match(seg, i).end()   # type: ignore[union-attr]
            out.append((i, j))
            i = seg.find(key, j)
    out.sort()
    return out


def uncut(ends: list[int], c: Cut) -> list[int] | None:
    """Ascending piece ends of ``c.text`` as ends of the uncut text; None if one lies inside a
    kept run away from its ends (the proof says none does: the caller pre-tokenizes uncut)."""
    out: list[int] = []
    runs, j = c.runs, 0
    for x in ends:
        while j < len(runs) and x >= runs[j][0] + KEEP:
            j += 1
        if j == len(runs):
            out.append(x + (runs[-1][2] if runs else 0))
            continue
        start, before, after = runs[j]
        into = x - start
        if into <= HEAD:                      # before the run, or next to its start
            out.append(x + before)
        elif into >= KEEP - TAIL:             # next to its end
            out.append(x + after)
        else:
            return None
    return out
