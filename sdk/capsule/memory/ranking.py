"""Ranking for memory retrieval: a dense cosine index and rank fusion with a lexical ranking.

Threading: ``EmbeddingIndex`` guards its state with one internal lock, so ``add``, ``remove``
and ``search`` may be called from several threads (each call is atomic; a search holds the lock
for its matrix product). ``fuse`` is a pure function.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F


class EmbeddingIndex:
    """Fact ids with their embeddings, stacked in one (capacity, dim) fp32 tensor on `device`.

    Rows are stored L2-normalized, so a search is one matrix product plus ``torch.topk``.
    Capacity doubles when full (amortized O(1) per added row); ``remove`` moves the last row
    into the hole, keeping rows [0, n) dense. Adding an id already present replaces its vector.
    """

    def __init__(self, dim: int, device: str | torch.device = "cpu", *, capacity: int = 64):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self.device = torch.device(device)
        self._embs = torch.zeros(max(1, capacity), dim, dtype=torch.float32, device=self.device)  # (C, D)
        self._ids: list[int] = []            # row -> fact id, for rows [0, n)
        self._row: dict[int, int] = {}       # fact id -> row
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, fact_id: object) -> bool:
        return fact_id in self._row

    def ids(self) -> list[int]:
        """The ids held, in row order (not meaningful beyond membership)."""
        with self._lock:
            return list(self._ids)

    def add(self, ids: Sequence[int], embs: torch.Tensor | np.ndarray) -> None:
        """Add (or replace) `ids` with rows of `embs` (len(ids), dim); rows are L2-normalized here."""
        ids = [int(i) for i in ids]
        embs = torch.as_tensor(embs).to(device=self.device, dtype=torch.float32)
        if embs.ndim == 1 and len(ids) == 1:
            embs = embs.unsqueeze(0)
        if embs.ndim != 2 or embs.shape[0] != len(ids) or embs.shape[1] != self.dim:
            raise ValueError(f"embs must be ({len(ids)}, {self.dim}), got {tuple(embs.shape)}")
        if len(set(ids)) != len(ids):
            raise ValueError("ids repeat within one add")
        if not ids:
            return
        embs = F.normalize(embs, p=2, dim=1)  # (M, D); a zero vector stays zero (scores 0)
        with self._lock:
            old_n, rows = len(self._ids), []
            for i in ids:
                r = self._row.get(i)
                if r is None:
                    r = self._row[i] = len(self._ids)
                    self._ids.append(i)
                rows.append(r)
            self._reserve(len(self._ids), keep=old_n)
            self._embs[torch.tensor(rows, device=self.device)] = embs

    def remove(self, ids: Iterable[int]) -> int:
        """Drop `ids` (unknown ids are ignored); returns how many were removed."""
        removed = 0
        with self._lock:
            for i in ids:
                r = self._row.pop(int(i), None)
                if r is None:
                    continue
                last = len(self._ids) - 1
                if r != last:   # move the last row into the hole: rows stay dense, no reindexing
                    moved = self._ids[last]
                    self._embs[r] = self._embs[last]
                    self._ids[r] = moved
                    self._row[moved] = r
                self._ids.pop()
                removed += 1
        return removed

    def search(self, query_emb: torch.Tensor | np.ndarray, k: int) -> list[tuple[int, float]]:
        """Top-`k` (id, cosine similarity), best first; equal scores ordered by id."""
        q = torch.as_tensor(query_emb).to(device=self.device, dtype=torch.float32).reshape(-1)  # (D,)
        if q.shape[0] != self.dim:
            raise ValueError(f"query has dim {q.shape[0]}, index has {self.dim}")
        q = F.normalize(q, p=2, dim=0)
        with self._lock:
            n = len(self._ids)
            k = min(int(k), n)
            if k <= 0:
                return []
            scores = self._embs[:n] @ q                  # (N,): one GEMV over every fact
            top = torch.topk(scores, k)                  # sorted, largest first
            vals, rows = top.values.tolist(), top.indices.tolist()
            hits = [(self._ids[r], v) for r, v in zip(rows, vals)]
        hits.sort(key=lambda h: (-h[1], h[0]))           # topk leaves ties in no stated order
        return hits

    def _reserve(self, n: int, keep: int) -> None:
        """Room for `n` rows, copying the first `keep`; doubles so growth is amortized O(1)."""
        cap = self._embs.shape[0]
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        grown = torch.zeros(cap, self.dim, dtype=torch.float32, device=self.device)  # (C', D)
        grown[:keep] = self._embs[:keep]
        self._embs = grown


def fuse(lexical: Sequence[tuple[int, float]], semantic: Sequence[tuple[int, float]], k: int,
         *, rrf_k: int = 60) -> list[tuple[int, float]]:
    """Merge a lexical and a semantic ranking of fact ids into the top-`k` (id, fused score).

    Reciprocal-rank fusion (Cormack, Clarke & Buettcher, SIGIR 2009): score(id) = sum over the
    lists holding it of 1 / (rrf_k + rank), rank 1-based. Chosen because BM25-like scores and
    cosines live on unrelated scales; RRF uses only ranks, needs no calibration or weights, and
    is robust with the standard rrf_k = 60. Each list is ranked by its scores (descending);
    equal scores share the better rank (competition ranking), so neither input order nor ids
    favour a fact within a list. A repeated id keeps its best score. Output: fused score
    descending, ties by ascending id. Either list may be empty.
    """
    if rrf_k < 0:
        raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
    if k <= 0:
        return []
    fused: dict[int, float] = {}
    for ranking in (lexical, semantic):
        for fid, rank in _ranks(ranking).items():
            fused[fid] = fused.get(fid, 0.0) + 1.0 / (rrf_k + rank)
    return sorted(fused.items(), key=lambda h: (-h[1], h[0]))[:k]


def _ranks(ranking: Sequence[tuple[int, float]]) -> dict[int, int]:
    """id -> 1-based competition rank (equal scores share the best rank)."""
    best: dict[int, float] = {}
    for fid, score in ranking:
        fid, score = int(fid), float(score)
        if fid not in best or score > best[fid]:
            best[fid] = score
    ordered = sorted(best.items(), key=lambda h: -h[1])
    ranks: dict[int, int] = {}
    prev, rank = None, 0
    for pos, (fid, score) in enumerate(ordered, start=1):
        if score != prev:
            rank, prev = pos, score
        ranks[fid] = rank
    return ranks


__all__ = ["EmbeddingIndex", "fuse"]
