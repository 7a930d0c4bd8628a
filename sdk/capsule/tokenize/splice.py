"""The splice rule: which stored piece boundary a window may start at, and new boundaries.

``SpliceRule.choose`` picks the latest stored boundary ``a`` before the first changed char
``m`` that is proven stable (docs/TOKENIZATION.md):

* anchor: the char before ``a`` ends a letter or digit run (its class is L/N/K and the char at
  ``a`` is of another, certain class). Such a run is the end of its match in every continuation,
  and no match before it looks past ``a``. If the char at ``a`` occurs right after a letter/digit
  inside some special token (or some special token ends in a letter/digit), ``a`` must also
  lie ``margin`` chars before ``m``;
* digit groups (Rule 3): both chars digits, in a family whose digit pieces are 1 or up to 3
  digits counted from the run's start: a boundary inside a digit run stays one;
* run rule: at least four class changes in ``T[a-1 : m-margin]``, margin = max(4, longest
  special token), so every decision before ``a`` and at ``a`` ended well before ``m`` and
  before any special token that an edit could complete;
* added-token ends (Rule 4): the token before ``a`` is a special/added token, its text ends at
  ``a``, ``a <= m - margin``, and the family splits them out in one pass: every match that starts
  before ``a`` lies inside the unchanged text (GPT-NeoX's runs of 24-space tokens).

For NFC families ``a`` must also be a point where NFC cannot reach across.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .pieces import PieceScanner
from .rules import CharInfo, Rules

SCAN_MAX = 65536      # longest region cut into pieces for new boundaries
ANCHOR_SEARCH = 4096  # how far back a split anchor is looked for
RUN_SEARCH = 16384    # how far back the run rule looks for four class changes


@dataclass(frozen=True)
class Splice:
    """The token list becomes ``old[:keep] + ids``."""
    keep: int
    ids: list[int]


# admit(n): called with an edit's new token count before anything changes; raise to refuse it
Admit = Callable[[int], None] | None


def common(a: Any, b: Any, lo: int = 0) -> int:
    """Length of the common prefix of two sequences, known equal up to ``lo``."""
    n = min(len(a), len(b))
    step = 256
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while a[lo] == b[lo]:
                lo += 1
            return lo
        lo, step = hi, step * 2
    return n


def gather(starts: list[int], parts: Sequence[Sequence[Any]], tail: Sequence[Any], base: int,
           lo: int, hi: int) -> list[Sequence[Any]]:
    """The pieces of ``parts + [tail]`` covering positions lo..hi-1 of their concatenation,
    where ``parts[j]`` starts at ``starts[j]`` and ``tail`` at ``base`` (frozen chunks and the
    tail of a text or of its ids): O(what is returned), plus a bisect."""
    out: list[Sequence[Any]] = []
    if lo < base and hi > lo:
        j = max(0, bisect_right(starts, lo) - 1)
        while j < len(parts) and starts[j] < hi:
            out.append(parts[j][max(0, lo - starts[j]):hi - starts[j]])
            j += 1
    if hi > base:
        out.append(tail[max(0, lo - base):hi - base])
    return out


class SpliceRule:
    """One family's rule, bound to a reference and a piece scanner."""

    def __init__(self, ref: Any, rules: Rules) -> None:
        self.ref, self.rules = ref, rules
        self.info = CharInfo(rules.marks_are_letters, rules.cjk_stage, rules.scheme)
        self.scanner = PieceScanner(ref, rules, self.info)
        self.tailscan = 2 * rules.margin + 64   # new boundaries are kept this far back at least
        # Rule 4 needs one pass of special-token matching (tokenizers matches non-normalized
        # added tokens before normalized ones: a second pass is not covered by the proof)
        one_pass = not rules.first_pass or rules.first_pass == frozenset(rules.specials)
        self._added = {i: s for s, i in rules.specials.items()} if one_pass else {}

    def choose(self, t: str, m: int, bpos: list[int], base: int, before: str,
               last_id: Callable[[int], int] | None = None) -> tuple[int | None, bool]:
        """(index of the latest stable stored boundary < m, whether it is not the latest).

        last_id(i): the id of the token that ends at boundary i, -1 if unknown (Rule 4)."""
        r, info = self.rules, self.info
        first = i = bisect_left(bpos, base + m) - 1
        k4 = None
        while i >= 0:
            a = bpos[i] - base
            if a == 0 and base == 0:
                break   # the start of the text: a full encode
            prev, c = (t[a - 1] if a > 0 else before), t[a]
            if not r.nfc or info.nfc_safe(prev, c):
                if (info.anchor(prev, c) or self._in_digits(prev, c)) and (
                        (c not in r.follow and not r.anchor_margin) or a <= m - r.margin):
                    break
                if last_id is not None and self._after_added(t, a, m, last_id(i)):
                    break
                if k4 is None:
                    k4 = self.fourth_change(t, m - r.margin - 1, before)
                if a <= k4:
                    break
            i -= 1
        return (None, False) if i < 0 else (i, i < first)

    def fourth_change(self, t: str, end: int, before: str) -> int:
        """Position of the 4th class change at or before ``end`` (going back), else -1."""
        found, k = 0, end
        stop = max(0, end - RUN_SEARCH)   # a longer search could only find as long a window
        cls, change = self.info.cls, self.info.change
        right = cls(t[k]) if 0 <= k < len(t) else "?"
        if right != "?":   # skip the run of t[end] at C speed: one char has one class
            k = stop + len(t[stop:end + 1].rstrip(t[end]))
            if k == stop:
                return -1   # one char throughout: at most one change (with `before`)
        while k > stop or (k == 0 and before):
            left = cls(t[k - 1]) if k > 0 else cls(before)
            if change(left, right):
                found += 1
                if found == 4:
                    return k
            right, k = left, k - 1
        return -1

    def split_point(self, w: str) -> int:
        """Latest anchor in w at least ``tailscan`` chars before its end, else 0."""
        r, info = self.rules, self.info
        hi = len(w) - self.tailscan
        covered: list[tuple[int, int]] | None = None
        for p in range(hi, max(0, hi - ANCHOR_SEARCH), -1):
            c0, c = w[p - 1], w[p]
            if r.nfc and not info.nfc_safe(c0, c):
                continue
            if not (info.anchor(c0, c) or (self._in_digits(c0, c) and self._group_start(w, p))):
                continue
            if c in r.follow:   # the lemmas need no special token of w over p-1, p
                if covered is None:
                    covered = [(s, e) for s, e, sid in self.scanner.split_specials(w)
                               if sid is not None]
                if any(s < p < e for s, e in covered):
                    continue
            return p
        return 0

    def _after_added(self, t: str, a: int, m: int, tok: int) -> bool:
        """Rule 4: ``a`` ends the added token ``tok`` (its text is ``T[a-len:a]``), and every
        special-token match that starts before ``a`` ends before ``m``."""
        s = self._added.get(tok)
        return (s is not None and len(s) <= a <= m - self.rules.margin
                and t.startswith(s, a - len(s)))

    def _added_split(self, w: str, ids_w: list[int]) -> int:
        """The end of the latest added token in ``ids_w`` at least ``tailscan`` chars before
        w's end (Rule 4: a piece boundary of w), else 0; for runs without anchors, such as
        GPT-NeoX's whitespace cut into 24-space tokens. Costs a dict lookup per id (at most
        ``4 * ANCHOR_SEARCH``) plus one decode of the suffix per added token met."""
        added, limit = self._added, 4 * ANCHOR_SEARCH
        for k in range(len(ids_w) - 1, max(0, len(ids_w) - limit), -1):
            s = added.get(ids_w[k - 1])   # the token before the boundary between k-1 and k
            if s is None:
                continue
            tail = self.ref.decode_bytes(ids_w[k:])
            if len(tail) > limit:
                return 0
            try:
                text = tail.decode("utf-8")
            except UnicodeDecodeError:
                continue
            p = len(w) - len(text)
            if len(text) >= self.tailscan and w.endswith(text) and w.startswith(s, p - len(s)):
                return p
        return 0

    def _in_digits(self, prev: str, c: str) -> bool:
        """Both chars digits, in a family whose digit pieces have a fixed length (Rule 3):
        a piece boundary between them stays one while the text before it stays."""
        info = self.info
        return bool(self.rules.digit_step) and info.cls(prev) == info.cls(c) == info.digit

    def _group_start(self, w: str, p: int) -> bool:
        """Whether p starts a digit piece of w: ``digit_step`` digits after w's run start.

        w starts at a piece boundary, so its digit groups are counted from the run's start
        inside w (or from w's start, itself a group start)."""
        step, cls, digit = self.rules.digit_step, self.info.cls, self.info.digit
        if step == 1:
            return True
        q = p
        while q > 0 and cls(w[q - 1]) == digit:
            q -= 1
        return (p - q) % step == 0

    def scan(self, w: str, ids_w: list[int], pos0: int, cnt0: int
             ) -> tuple[list[tuple[int, int]], bool]:
        """(new absolute boundaries inside w, whether a check failed).

        w starts at a boundary (pos0, cnt0) and ids_w are its reference ids. The split anchor
        p near the end gets its count from the reference's ids of w[p:]; the pieces of w[p:]
        are then checked against those ids.
        """
        p = self.split_point(w) or self._added_split(w, ids_w)
        ids_p = ids_w
        out: list[tuple[int, int]] = []
        if p:
            ids_p = self.ref.encode(w[p:])
            if len(ids_p) > len(ids_w) or ids_w[len(ids_w) - len(ids_p):] != ids_p:
                return out, True
            out.append((pos0 + p, cnt0 + len(ids_w) - len(ids_p)))
        if len(w) - p > SCAN_MAX:
            return out, False
        got = self.scanner.boundaries(w[p:], ids_p)
        if got is None:
            return out, True
        c0 = cnt0 + len(ids_w) - len(ids_p)
        out += [(pos0 + p + off, c0 + c) for off, c in got[:-1]]
        return out, False
