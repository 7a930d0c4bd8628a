"""Long runs of one space or tab char, cut short before pre-tokenizing and put back after.

A whitespace tail of 512 KiB costs the pre-tokenizer one pass over every char of it on every
append (5-15 ns per char for a tiktoken-style regex, 100-200 for the tokenizers library's
multi-stage pipelines). docs/TOKENIZATION.md ("Space runs") proves, for every verified pipeline
whose ``Verified.space_runs`` is set, that the pieces of ``A + c*n + B`` (``c`` a space or a tab,
``n >= KEEP``) are the pieces of ``A + c*KEEP + B`` with every end past the kept run's first
chars moved on by ``n - KEEP``: no piece ends inside the run except next to its two ends. An end
the proof rules out sends the caller to the uncut text (``uncut`` returns None).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KEEP = 16        # chars a cut run keeps: the proof needs 2 at its start and 2 at its end, and a
#                  pipeline stage may take the run's last char off (DeepSeek-LLM has 6 stages)
HEAD = 2         # a kept end at most this far into a run lies next to its start
TAIL = 8         # ... at most this far before its end: next to its end
RUN_MIN = 256    # shorter runs cost less to scan than to cut
_RUN = re.compile(r" {%d,}|\t{%d,}" % (RUN_MIN, RUN_MIN))


@dataclass(frozen=True)
class Cut:
    """``text`` with every run of ``RUN_MIN`` or more spaces (or tabs) cut to ``KEEP`` chars;
    ``runs``: (start of the kept run in ``text``, chars removed before it, chars removed up to
    its end)."""
    text: str
    runs: tuple[tuple[int, int, int], ...]


def cut(seg: str) -> Cut | None:
    """``seg`` with its long space and tab runs cut short, or None when it has none."""
    if len(seg) < RUN_MIN:
        return None
    parts: list[str] = []
    runs: list[tuple[int, int, int]] = []
    at = removed = 0
    for m in _RUN.finditer(seg):     # maximal runs: leftmost, greedy
        u, v = m.span()
        parts += (seg[at:u], seg[u] * KEEP)
        runs.append((u - removed, removed, removed + (v - u - KEEP)))
        removed += v - u - KEEP
        at = v
    if not runs:
        return None
    parts.append(seg[at:])
    return Cut("".join(parts), tuple(runs))


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
