"""The window of a text that ends in one giant pre-tokenizer piece (a whitespace run, a GPT-2
digit run, a letter run): its BPE is redone only near the edit.

The window ``w`` starts at a stable boundary, as every window does. Its pieces are cut as the
splice rule cuts them (``PieceScanner``, the family's own pre-tokenizer); when one of them is at
least ``LONG_MIN`` chars, ``ids(w) = ids(pieces before) + BPE(piece) + ids(rest)``:

* the pieces before are encoded alone and kept only if their own pieces are the same pieces;
* the piece's ids come from ``PieceBpe.reencode`` against the same piece's ids before the edit
  (docs/TOKENIZATION.md, "Long pieces"), or, the first time, from the reference's ids of ``w``;
* the rest starts at a piece boundary of ``w``, so the reference encodes it alone.

Pre-tokenizing ``w`` is one pass over it, with long space and tab runs cut short first
(space_runs.py); other long pieces (a GPT-2 digit or letter run) are still scanned whole (~5-15
ns per char for a tiktoken-style regex, 100-200 for the tokenizers library's multi-stage
pre-tokenizers). The merges, which cost the reference O(piece), are O(edit) here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .piece_bpe import PieceBpe, piece_bpe
from .pieces import PieceScanner
from .reference import ReferenceTokenizer

LONG_MIN = 2048     # chars: a window at least this long is looked at piece by piece


@dataclass(frozen=True)
class Seen:
    """The long piece of the current ids: absolute char start and end, tokens before it, its
    tokens, its UTF-8 bytes."""
    start: int
    end: int
    cnt: int
    n: int
    data: bytes


@dataclass(frozen=True)
class Encoded:
    """A window's new ids: the first ``keep`` (absolute) old ids stay, ``ids`` follow (their
    common start with the old ids is not trimmed here)."""
    keep: int
    ids: list[int]
    total: int                          # the new token count of the whole text
    bounds: list[tuple[int, int]]       # new absolute boundaries (char offset, token count)
    end: int                            # absolute char end of the long piece
    rest: list[int]                     # ids of the text after it
    seen: Seen
    redone: int                         # chars whose ids were computed afresh


class LongPieces:
    """One incremental tokenizer's long piece. Not thread-safe (the tokenizer's writer)."""

    def __init__(self, ref: ReferenceTokenizer, scanner: PieceScanner) -> None:
        self._ref, self._scanner = ref, scanner
        self._bpe: PieceBpe | None = None
        self._tried = False
        self.seen: Seen | None = None
        self._none = (-1, 0)   # a window start whose pieces were all short, and its length

    def forget_from(self, char: int) -> None:
        """Ids from absolute char ``char`` on were replaced by another path."""
        if self.seen is not None and char < self.seen.end:
            self.seen = None

    def _piece_bpe(self) -> PieceBpe | None:
        if not self._tried:
            self._tried = True
            self._bpe = piece_bpe(self._ref)
        return self._bpe

    def encode(self, w: str, pos: int, cnt: int, tids: list[int], base_n: int
               ) -> Encoded | None:
        """The ids of window ``w`` (absolute start ``pos``, ``cnt`` tokens before it) spliced
        into ``tids`` (the tail's ids, the first at absolute count ``base_n``); None when ``w``
        has no long piece this path can take (the caller encodes ``w`` whole)."""
        pb = self._piece_bpe()
        if pb is None:
            return None
        if self._none[0] == pos and len(w) < 2 * self._none[1]:
            return None        # looked at this window lately: cutting it again would double it
        found = self._find(w)
        if found is None:
            self._none = (pos, len(w))
            return None
        ids_pre, s, e = found
        try:
            data = w[s:e].encode("utf-8")
        except UnicodeEncodeError:
            return None
        if pb.whole(data) or (pb.dropped and len(data.translate(None, pb.dropped)) != len(data)):
            return None
        if not (self._scanner.whole_chars or data.isascii()):
            return None   # Falcon: this piece may be two of its pieces joined (BPE stops at cuts)
        ref = self._ref
        rest = ref.encode(w[e:])
        lo, cnt_s = cnt - base_n, cnt + len(ids_pre)
        old = self.seen
        got = None
        if (old is not None and old.start == pos + s and old.cnt == cnt_s
                and tids[lo:lo + len(ids_pre)] == ids_pre
                and cnt_s - base_n + old.n <= len(tids)):
            got = pb.reencode(old.data, tids, cnt_s - base_n, old.n, data)
        if got is not None:
            k, tail = got
            keep, new = cnt_s + k, tail + rest
            n_piece = k + len(tail)
            redone = len(w) - e + sum(pb.length(x) for x in tail)   # bytes ~ chars (runs)
        else:   # the first time (or a far edit): the reference's ids of the window
            ids_w = ref.encode(w)
            n_piece = len(ids_w) - len(ids_pre) - len(rest)
            if (n_piece <= 0 or ids_w[:len(ids_pre)] != ids_pre
                    or ids_w[len(ids_w) - len(rest):] != rest):
                return None
            keep, new = cnt, ids_w
            redone = len(w)
        cnt_e = cnt_s + n_piece
        # the piece's end is a boundary unless it ends the text; its start is stored by no one:
        # freezing there would leave the next edit no stable boundary before the run
        bounds = [(pos + e, cnt_e)] if e < len(w) else []
        return Encoded(keep, new, keep + len(new), bounds, pos + e, rest,
                       Seen(pos + s, pos + e, cnt_s, n_piece, data), redone)

    def _find(self, w: str) -> tuple[list[int], int, int] | None:
        """(ids of the pieces before, start, end) of the first long piece of ``w``'s first
        segment, or None."""
        sc = self._scanner
        segs = sc.split_specials(w)
        if not segs or segs[0][2] is not None:
            return None
        seg = w[:segs[0][1]]
        ends = sc.pieces(seg)
        if not ends or ends[-1] != len(seg):
            return None
        at = 0
        for j, end in enumerate(ends):
            if end - at >= LONG_MIN:
                if at == 0:
                    return [], 0, end
                pre = w[:at]
                if sc.pieces(pre) != ends[:j]:   # alone, the text before cuts otherwise
                    return None
                return self._ref.encode(pre), at, end
            at = end
        return None
