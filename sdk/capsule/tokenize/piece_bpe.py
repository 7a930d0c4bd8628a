"""BPE of one long pre-tokenizer piece after an edit near its end, in time for the edit.

A valid encoding is one BPE itself produces. Two facts (docs/TOKENIZATION.md, "Long pieces")
make a long piece's encoding re-usable: a run of a valid encoding is valid for its own bytes, and
two valid encodings that share their seam token ``x | x`` join into a valid one when the seam
pair ``(last of the left, first of the right)`` is itself valid. So after an edit at byte ``c``
of a piece whose old ids are known, ``BPE(new) = old[:k] + BPE(new[q:])`` for the token
boundary ``q <= c`` that ends ``old[:k]``, whenever the pair ``(old[k-1], BPE(new[q:])[0])``
is valid; otherwise an earlier ``q`` is tried. Only ``new[q:]`` is merged here, in Python.

Merge order is the references' own (tiktoken's and tokenizers' loops are the same rule): among
adjacent pairs with a merge, the lowest rank merges first, the leftmost among equal ranks.
"""
from __future__ import annotations

import heapq
import threading
from typing import TYPE_CHECKING, Mapping, Sequence

from .reference import ReferenceTokenizer
from .rules import rules_for
from .splice import common

if TYPE_CHECKING:   # the table is built by tensor_bpe (torch) only when a long piece shows up
    from edge_kernels.bpe import MergeTable

MAX_REDO = 4096    # most bytes merged here per edit; a larger edit is the reference's job


class PieceBpe:
    """Pure BPE over one vocabulary's merge table (no whole-piece shortcut), and the seam
    check. Safe to share across threads (its caches only ever gain right answers)."""

    def __init__(self, table: MergeTable, ref: ReferenceTokenizer, whole: Mapping[bytes, int],
                 dropped: bytes) -> None:
        stride = table.stride
        self._pairs = {k: (r, m) for k, r, m in zip(table.keys.tolist(), table.ranks.tolist(),
                                                    table.merged.tolist())}
        self._stride = stride
        self._byte_ids = table.byte_ids.tolist()
        self._ref = ref
        self.dropped = dropped        # bytes without a symbol: a piece holding one is refused
        self._whole = whole           # pieces the reference emits as one token, unmerged
        self._longest = max(map(len, whole), default=0)
        self._len: dict[int, int] = {}
        self._valid: dict[tuple[int, int], bool] = {}

    def whole(self, piece: bytes) -> bool:
        """Whether the reference emits ``piece`` as one token without merging (tiktoken's and
        ``ignore_merges``' shortcut): BPE does not decide such a piece."""
        return len(piece) <= self._longest and piece in self._whole

    def length(self, tok: int) -> int:
        """Bytes of one token."""
        n = self._len.get(tok)
        if n is None:
            n = self._len[tok] = len(self._ref.decode_bytes([tok]))
        return n

    def encode(self, data: bytes) -> list[int]:
        """The ids BPE gives ``data`` as one piece, O(len log len)."""
        ids = [self._byte_ids[b] for b in data]
        n = len(ids)
        if n < 2:
            return ids
        nxt = list(range(1, n + 1))       # linked list over positions; n = the end
        prv = list(range(-1, n - 1))
        pairs, stride = self._pairs, self._stride
        heap = []
        for i in range(n - 1):
            got = pairs.get(ids[i] * stride + ids[i + 1])
            if got is not None:
                heap.append((got[0], i, ids[i], ids[i + 1], got[1]))
        heapq.heapify(heap)
        alive = [True] * n
        while heap:
            _, i, left, right, merged = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j >= n or ids[i] != left or ids[j] != right:
                continue   # stale: a symbol of this pair changed since it was pushed
            ids[i] = merged
            alive[j] = False
            nxt[i] = k = nxt[j]
            if k < n:
                prv[k] = i
                got = pairs.get(merged * stride + ids[k])
                if got is not None:
                    heapq.heappush(heap, (got[0], i, merged, ids[k], got[1]))
            h = prv[i]
            if h >= 0:
                got = pairs.get(ids[h] * stride + merged)
                if got is not None:
                    heapq.heappush(heap, (got[0], h, ids[h], merged, got[1]))
        return [ids[i] for i in range(n) if alive[i]]

    def valid_pair(self, left: int, right: int) -> bool:
        """Whether ``[left, right]`` is what BPE gives their bytes."""
        key = (left, right)
        ok = self._valid.get(key)
        if ok is None:
            data = self._ref.decode_bytes([left, right])
            ok = self._valid[key] = self.encode(data) == [left, right]
        return ok

    def reencode(self, old: bytes, ids: Sequence[int], lo: int, n: int, new: bytes,
                 max_redo: int = MAX_REDO) -> tuple[int, list[int]] | None:
        """``(k, tail)`` with ``BPE(new) == old_ids[:k] + tail``, given ``old_ids ==
        ids[lo:lo+n] == BPE(old)`` (read in place: no copy of a long piece's ids); None when no
        seam within ``max_redo`` bytes of the end qualifies."""
        c = common(old, new)
        k, pos = n, len(old)
        while pos > c:                   # back to a token boundary of old inside new
            k -= 1
            pos -= self.length(ids[lo + k])
        step = 1
        while True:
            if len(new) - pos > max_redo:
                return None
            tail = self.encode(new[pos:])
            if k == 0 or not tail or self.valid_pair(ids[lo + k - 1], tail[0]):
                return k, tail
            for _ in range(step):        # the seam is not valid: start further back
                if k == 0:
                    break
                k -= 1
                pos -= self.length(ids[lo + k])
            step *= 2


_shared: dict[str, PieceBpe] = {}
_lock = threading.Lock()


def piece_bpe(ref: ReferenceTokenizer) -> PieceBpe | None:
    """The shared PieceBpe of a vocabulary with a verified pipeline (None otherwise); the
    first call builds the merge table (~0.1-1 s), later ones are a lookup. Falcon gets one too:
    its pieces are BPE'd alone like any other's (the caller takes only pieces that are surely
    whole, ``PieceScanner.whole_chars``)."""
    if rules_for(ref)[0] is None:   # not tensor_bpe.unsupported: that one refuses Falcon
        return None
    from .tensor_bpe import merge_table   # torch, only once a long piece shows up
    key = ref.fingerprint
    with _lock:
        got = _shared.get(key)
    if got is None:
        table, whole, dropped = merge_table(ref)
        got = PieceBpe(table, ref, whole, dropped)
        with _lock:
            got = _shared.setdefault(key, got)
    return got
