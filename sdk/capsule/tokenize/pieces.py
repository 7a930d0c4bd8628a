"""Piece boundaries of a text window, checked against the reference's own ids for that window.

Special/added tokens are split out first (leftmost-longest; tokenizers' non-normalized tokens in
a first pass), then each ordinary segment is cut into pre-tokenizer pieces: by the family's
pattern with the ``regex`` module (tiktoken families) or by the reference's own
``piece_spans`` (tokenizer.json families). The check: the reference's encodings of the pieces,
one by one, concatenated, must equal the reference's encoding of the whole window. Only then are
the piece ends kept as boundaries (char offset, token count).
"""
from __future__ import annotations

from typing import Any, Sequence

from .rules import CharInfo, Rules
from .space_runs import cut, uncut

_CACHE_MAX = 1 << 14


class _Table:
    """Special token strings of one pass, looked up by first char and length."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = frozenset(tokens)
        self.firsts = sorted({t[0] for t in self.tokens})
        self.lengths = sorted({len(t) for t in self.tokens}, reverse=True)

    def find(self, text: str, lo: int, hi: int) -> list[tuple[int, int]]:
        """Leftmost-longest non-overlapping occurrences in text[lo:hi]."""
        out: list[tuple[int, int]] = []
        nxt = {c: text.find(c, lo, hi) for c in self.firsts}
        i = lo
        while True:
            live = [p for p in nxt.values() if p >= 0]
            if not live:
                return out
            p = min(live)
            i = p + 1
            for n in self.lengths:
                if p + n <= hi and text[p:p + n] in self.tokens:
                    out.append((p, p + n))
                    i = p + n
                    break
            for c, q in nxt.items():
                if 0 <= q < i:
                    nxt[c] = text.find(c, i, hi)


class PieceScanner:
    """Cuts windows into pieces and checks them; one per incremental tokenizer."""

    def __init__(self, ref: Any, rules: Rules, info: CharInfo) -> None:
        import regex   # only reached when rules_for found the regex package
        self._ref, self._rules, self._info = ref, rules, info
        self._re = regex.compile(rules.pattern) if rules.pattern is not None else None
        first = [t for t in rules.specials if t in rules.first_pass]
        rest = [t for t in rules.specials if t not in rules.first_pass]
        self._passes = [_Table(p) for p in (first, rest) if p]
        self._cache: dict[str, tuple[int, ...]] = {}
        # Uncached pieces are encoded in one reference call, joined by a special token.
        seps = [t for t in ("<|endoftext|>", "<｜end▁of▁sentence｜>") if t in rules.specials]
        seps += [t for t in first if t not in seps] + [t for t in rest if t not in seps]
        self._sep = seps[0] if seps else None

    @property
    def whole_chars(self) -> bool:
        """Whether every piece here is one of the pipeline's own pieces. False for Falcon,
        whose stages after ByteLevel may cut inside a character: the pieces here join such a
        cut back, so only an all-ASCII piece is surely one of its pieces."""
        return self._rules.whole_chars

    def split_specials(self, text: str) -> list[tuple[int, int, int | None]]:
        """(start, end, special id or None) segments covering text, in order."""
        segs: list[tuple[int, int, int | None]] = [(0, len(text), None)] if text else []
        for table in self._passes:
            out: list[tuple[int, int, int | None]] = []
            for s, e, sid in segs:
                if sid is not None:
                    out.append((s, e, sid))
                    continue
                at = s
                for p, q in table.find(text, s, e):
                    if p > at:
                        out.append((at, p, None))
                    out.append((p, q, self._rules.specials[text[p:q]]))
                    at = q
                if at < e:
                    out.append((at, e, None))
            segs = out
        return segs

    def pieces(self, seg: str) -> list[int]:
        """Ends of the pre-tokenizer pieces of one ordinary segment (its long space runs, and
        trailing digit run, cut short first where the pipeline allows: space_runs.py)."""
        short = cut(seg, self._rules.space_runs, self._rules.digit_runs)
        if short is not None:
            ends = self._pieces(short.text)
            got = uncut(ends, short) if ends else None
            if got is not None:
                return got
        return self._pieces(seg)

    def _pieces(self, seg: str) -> list[int]:
        spans = ([m.span() for m in self._re.finditer(seg)] if self._re is not None
                 else self._ref.piece_spans(seg))
        ends: list[int] = []
        at = 0
        for s, e in spans:   # tiktoken patterns match every char; a gap means a disagreement
            if s > at or e < s:
                return []
            if s < at:   # a cut inside a char (a stage after ByteLevel: Falcon's digit runs
                ends[-1] = max(ends[-1], e)   # cut byte symbols): one piece with the one before
            else:
                ends.append(e)
            at = ends[-1]
        return ends

    def boundaries(self, text: str, ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """(char offset, token count) of every piece end in text, or None if the check fails."""
        plan: list[tuple[int, str | None, int | None]] = []   # (end, piece, special id)
        for s, e, sid in self.split_specials(text):
            if sid is not None:
                plan.append((e, None, sid))
                continue
            at = s
            seg = text[s:e]
            ends = self.pieces(seg)
            if not ends or ends[-1] != len(seg):
                return None
            for end in ends:
                plan.append((s + end, text[at:s + end], None))
                at = s + end
        enc = self._encode_pieces([p for _, p, _ in plan if p is not None])
        tids = tuple(ids)
        out: list[tuple[int, int]] = []
        n = 0
        for end, piece, sid in plan:
            got = (sid,) if sid is not None else enc[piece]
            k = len(got)
            if tids[n:n + k] != got:
                return None
            n += k
            out.append((end, n))
        return out if n == len(tids) else None

    def _encode_pieces(self, pieces: list[str]) -> dict[str, tuple[int, ...]]:
        cache = self._cache
        uniq = list(dict.fromkeys(pieces))
        if len(cache) + len(uniq) > _CACHE_MAX:
            cache.clear()
        miss = [p for p in uniq if p not in cache]
        if miss:
            batch, alone = [], []
            for p in miss:   # NFC could compose a piece's first char with the separator's '>'
                ok = not self._rules.nfc or self._info.nfc_safe(">", p[0])
                (batch if ok and self._sep is not None else alone).append(p)
            if len(batch) > 1:
                parts = self._split(self._ref.encode(self._sep.join(batch)))
                if parts is None or len(parts) != len(batch):
                    alone += batch
                else:
                    cache.update(zip(batch, parts))
            else:
                alone += batch
            for p in alone:
                cache[p] = tuple(self._ref.encode(p))
        return cache

    def _split(self, ids: list[int]) -> list[tuple[int, ...]] | None:
        sep_id = self._rules.specials[self._sep]
        out, cur = [], []
        for i in ids:
            if i == sep_id:
                out.append(tuple(cur))
                cur = []
            else:
                cur.append(i)
        out.append(tuple(cur))
        return out
