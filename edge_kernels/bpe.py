"""Byte-level BPE merges over many pre-token pieces at once, as tensor operations.

Sequential BPE (tiktoken's ``_byte_pair_merge``, tokenizers' ``Word::merge_all``) repeats: find
the adjacent pair with the lowest rank, leftmost on ties, and merge it. Here every piece of a
batch is a row of a (B, L) id tensor and one *round* does, for all rows at once:

1. look up the rank of every adjacent pair (one ``searchsorted`` into the sorted pair keys);
2. take each row's lowest rank r and its occurrences, leftmost-first and non-overlapping;
3. merge a prefix of those occurrences: occurrence k is kept while merging occurrences 1..k-1
   created no pair ranked below r. That is exactly what the sequential loop does: after a merge
   the lowest pair is still r (created pairs rank above r, a pair never ties a different merge)
   and the leftmost remaining occurrence is the next one, until a merge creates a pair below r;
   the round stops right after that merge and the next round starts from the sequential state;
4. compact the rows (a merged pair leaves a hole) and drop rows with nothing left to merge.

Pieces are bucketed by byte length so a long run of spaces does not pad the whole batch.
Everything runs on CPU tensors and, unchanged, on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

NO_RANK = 1 << 62   # rank of a pair that never merges


@dataclass(frozen=True)
class MergeTable:
    """Every mergeable pair of one vocabulary, sorted by key = left * stride + right."""
    keys: torch.Tensor       # (P,) int64, ascending
    ranks: torch.Tensor      # (P,) int64, lower merges first
    merged: torch.Tensor     # (P,) int64, id of the merged token
    byte_ids: torch.Tensor   # (256,) int64, id of each single byte
    stride: int

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device: torch.device | str) -> "MergeTable":
        return MergeTable(self.keys.to(device), self.ranks.to(device), self.merged.to(device),
                          self.byte_ids.to(device), self.stride)


def _table(pairs: Mapping[tuple[int, int], tuple[int, int]], byte_ids: Sequence[int],
           n_ids: int) -> MergeTable:
    if len(byte_ids) != 256 or min(byte_ids) < 0:
        raise ValueError("a byte-level BPE needs an id for each of the 256 bytes")
    stride = max(n_ids, 1)
    if not pairs:
        empty = torch.empty(0, dtype=torch.int64)
        return MergeTable(empty, empty, empty, torch.tensor(byte_ids, dtype=torch.int64), stride)
    k = torch.tensor([a * stride + b for a, b in pairs], dtype=torch.int64)
    rm = torch.tensor(list(pairs.values()), dtype=torch.int64)       # (P, 2): rank, merged id
    order = torch.argsort(k)
    return MergeTable(k[order].contiguous(), rm[order, 0].contiguous(),
                      rm[order, 1].contiguous(), torch.tensor(byte_ids, dtype=torch.int64), stride)


def table_from_ranks(ranks: Mapping[bytes, int]) -> MergeTable:
    """tiktoken semantics: a pair's rank is the rank of its concatenated bytes, and ids are ranks.

    Any split of a token into two tokens is a mergeable pair (tiktoken never asks how a token
    was trained, only whether the concatenation is ranked).
    """
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for tok, rank in ranks.items():
        for s in range(1, len(tok)):
            a, b = ranks.get(tok[:s]), ranks.get(tok[s:])
            if a is not None and b is not None:
                pairs[(a, b)] = (rank, rank)
    try:
        byte_ids = [ranks[bytes([i])] for i in range(256)]
    except KeyError as exc:
        raise ValueError(f"rank table has no rank for byte {exc}") from exc
    return _table(pairs, byte_ids, max(ranks.values()) + 1)


def table_from_merges(vocab: Mapping[str, int], merges: Sequence[tuple[str, str]],
                      byte_chars: Sequence[str]) -> MergeTable:
    """tokenizers semantics: only listed merges apply, ranked by their line (a repeated pair
    keeps its last line, as tokenizers' merge map does); ``byte_chars[b]`` is byte b's symbol."""
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, (a, b) in enumerate(merges):
        ia, ib, im = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or im is None:
            raise ValueError(f"merge {rank} ({a!r} {b!r}) names a token missing from the vocab")
        pairs[(ia, ib)] = (rank, im)
    try:
        byte_ids = [vocab[c] for c in byte_chars]
    except KeyError as exc:
        raise ValueError(f"vocab lacks the byte-level symbol {exc}") from exc
    return _table(pairs, byte_ids, max(vocab.values()) + 1)


def _lookup(table: MergeTable, left: torch.Tensor, right: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, merged id) of pairs (left, right); NO_RANK where either is padding or no merge."""
    valid = (left >= 0) & (right >= 0)
    q = torch.where(valid, left * table.stride + right, -1)
    if table.keys.numel() == 0:
        return torch.full_like(q, NO_RANK), torch.full_like(q, -1)
    at = torch.searchsorted(table.keys, q).clamp_(max=table.keys.numel() - 1)
    hit = valid & (table.keys[at] == q)
    return torch.where(hit, table.ranks[at], NO_RANK), torch.where(hit, table.merged[at], -1)


def merge_rows(ids: torch.Tensor, table: MergeTable) -> torch.Tensor:
    """Run BPE to completion on each row of ``ids`` (B, L), padded with -1 on the right.

    Returns a tensor of the same shape: each row's final tokens, left-aligned, -1 after them.
    """
    B, L = ids.shape
    if B == 0 or L < 2:
        return ids.clone()
    out = torch.full_like(ids, -1)
    rows = torch.arange(B, device=ids.device)       # which output row each live row is
    cur = ids.clone()
    while rows.numel():
        rank, merged = _lookup(table, cur[:, :-1], cur[:, 1:])              # (b, l-1)
        rmin = rank.min(dim=1).values                                        # (b,)
        done = rmin == NO_RANK
        if bool(done.any()):     # finished rows leave the batch (one host sync per round)
            out[rows[done], :cur.shape[1]] = cur[done]
            keep = ~done
            rows, cur, rank, merged, rmin = rows[keep], cur[keep], rank[keep], merged[keep], rmin[keep]
            if not rows.numel():
                break
        cur = _round(cur, rank, merged, rmin, table)
    return out


def _round(cur: torch.Tensor, rank: torch.Tensor, merged: torch.Tensor, rmin: torch.Tensor,
           table: MergeTable) -> torch.Tensor:
    """One parallel merge round (see the module docstring); returns the compacted rows."""
    b, l = cur.shape
    n = l - 1
    occ = rank == rmin[:, None]                                              # (b, n)
    # leftmost-first, non-overlapping: inside a run of consecutive occurrences take every other
    c = occ.long().cumsum(1)
    run_start = torch.cummax(torch.where(occ, 0, c), dim=1).values
    sel = occ & ((c - run_start) % 2 == 1)
    # neighbours at the time the sequential loop merges occurrence j: the left one is already
    # merged when the previous selected occurrence ends right before j; the right one is not
    left_old = torch.cat([cur.new_full((b, 1), -1), cur[:, :n - 1]], dim=1)  # cur[j-1]
    prev_sel = torch.cat([sel.new_zeros((b, 2)), sel[:, :n - 2]], dim=1)[:, :n]
    prev_merged = torch.cat([merged.new_full((b, 2), -1), merged[:, :n - 2]], dim=1)[:, :n]
    left = torch.where(prev_sel, prev_merged, left_old)
    right = torch.cat([cur[:, 2:], cur.new_full((b, 1), -1)], dim=1)         # cur[j+2]
    lr, _ = _lookup(table, left, merged)
    rr, _ = _lookup(table, merged, right)
    unsafe = sel & ((lr < rmin[:, None]) | (rr < rmin[:, None]))
    pos = torch.arange(n, device=cur.device).expand(b, n)
    first_unsafe = torch.where(unsafe, pos, n).min(dim=1).values
    sel &= pos <= first_unsafe[:, None]
    # write the merged ids, punch out the right halves, and compact each row
    nxt = cur.clone()
    nxt[:, :n] = torch.where(sel, merged, cur[:, :n])
    drop = torch.cat([sel.new_zeros((b, 1)), sel], dim=1)                   # (b, l)
    dest = torch.where(drop, l, (~drop).long().cumsum(1) - 1)
    packed = cur.new_full((b, l + 1), -1)
    packed.scatter_(1, dest, nxt)
    width = int((packed[:, :l] >= 0).sum(1).max())   # rows only shrink: trim the padding
    return packed[:, :max(width, 2)]


# per length bucket: piece indices (a list, or a tensor on the device), (b, w) ids
Packed = list[tuple["list[int] | torch.Tensor", torch.Tensor]]


def pack_pieces(pieces: Sequence[bytes], table: MergeTable) -> Packed:
    """Pieces as padded byte-id rows on ``table.device``, one tensor per length bucket
    (1 | 2 | 3-4 | 5-8 | ... bytes), so a long run of spaces pads only its own bucket."""
    if not pieces:
        return []
    dev = table.device
    lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
    if int(lengths.min()) <= 0:
        raise ValueError("pieces must be non-empty byte strings")
    flat = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8).to(dev)
    flat_ids = table.byte_ids[flat.long()]                                    # (total,)
    starts = (torch.cumsum(lengths, 0) - lengths).to(dev)
    lengths_d = lengths.to(dev)
    bucket = torch.ceil(torch.log2(lengths.double())).long()
    packed: Packed = []
    for bk in torch.unique(bucket).tolist():
        members = torch.nonzero(bucket == bk).flatten()
        idx, col = members.to(dev), torch.arange(1 << bk, device=dev)
        inside = col[None, :] < lengths_d[idx][:, None]                       # (b, w)
        gather = (starts[idx][:, None] + col[None, :]).clamp_(max=flat_ids.numel() - 1)
        packed.append((members.tolist(), torch.where(inside, flat_ids[gather], -1)))
    return packed


def pack_spans(data: torch.Tensor, starts: torch.Tensor, table: MergeTable) -> Packed:
    """``pack_pieces`` for pieces given as byte offsets into a UTF-8 tensor already on the
    device: piece k is data[starts[k]:starts[k+1]] (the last one runs to the end). Piece
    indices stay tensors: nothing goes to the host but the set of length buckets."""
    n, dev = data.numel(), data.device
    if starts.numel() == 0:
        return []
    ends = torch.cat([starts[1:], torch.tensor([n], device=dev)])
    lengths = ends - starts                                                    # (P,) >= 1
    flat_ids = table.byte_ids[data.long()]
    bucket = torch.ceil(torch.log2(lengths.double())).long()
    packed: Packed = []
    for bk in torch.unique(bucket).tolist():
        members = torch.nonzero(bucket == bk).flatten()
        col = torch.arange(1 << bk, device=dev)
        inside = col[None, :] < lengths[members][:, None]                      # (b, w)
        gather = (starts[members][:, None] + col[None, :]).clamp_(max=n - 1)
        packed.append((members, torch.where(inside, flat_ids[gather], -1)))
    return packed


def flatten(packed: Packed, n_pieces: int) -> torch.Tensor:
    """All pieces' ids in piece order as one tensor, on the rows' device (no host copy)."""
    if not packed:
        return torch.zeros(0, dtype=torch.int64)
    dev = packed[0][1].device
    counts = torch.zeros(n_pieces, dtype=torch.int64, device=dev)
    for members, rows in packed:
        counts[torch.as_tensor(members, device=dev)] = (rows >= 0).sum(1)
    offsets = torch.cumsum(counts, 0) - counts                                 # (P,) first slot
    out = torch.empty(int(counts.sum()), dtype=torch.int64, device=dev)
    for members, rows in packed:
        keep = rows >= 0                                                       # left-aligned ids
        slot = offsets[torch.as_tensor(members, device=dev)][:, None] + torch.cumsum(keep, 1) - 1
        out[slot[keep]] = rows[keep]
    return out


def merge_packed(packed: Packed, table: MergeTable) -> Packed:
    """merge_rows on every bucket (no host copies besides the per-round row count)."""
    return [(members, merge_rows(rows, table)) for members, rows in packed]


def unpack(packed: Packed, n: int) -> list[list[int]]:
    """Each piece's ids, in piece order, as Python lists."""
    result: list[list[int]] = [[] for _ in range(n)]
    for members, rows in packed:
        keep = rows >= 0
        flat = rows[keep].tolist()
        at = 0
        for i, c in zip(members, keep.sum(1).tolist()):
            result[i] = flat[at:at + c]
            at += c
    return result


def merge_pieces(pieces: Sequence[bytes], table: MergeTable) -> list[list[int]]:
    """BPE ids of each piece (non-empty bytes), merged on ``table.device``."""
    return unpack(merge_packed(pack_pieces(pieces, table), table), len(pieces))
