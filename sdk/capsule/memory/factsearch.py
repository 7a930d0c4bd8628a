"""Lexical search over fact texts and tags: BM25 with SQLite FTS5, kept in this process.

The index is a cache of the store's fact rows: built from them on the first search (an in-memory
SQLite database, one FTS5 table; rowid = fact id), kept in step with this process's own writes,
and built again when the store's record generation moved by anything else (another writer, a
rebuilt index). Where SQLite lacks FTS5, search scans the rows and scores 1 + ln(occurrences)
per query word found (whole words, case-folded, no stemming).

The query is plain text: its words are extracted, so no FTS5 syntax in it is ever parsed.
Threading: one lock guards the index; FactTable calls it.
"""
from __future__ import annotations

import functools
import math
import re
import sqlite3
import threading
from collections import Counter
from typing import Callable, Iterable

MAX_QUERY_TERMS = 64
_WORD = re.compile(r"[^\W_]+")  # runs of letters / digits: what FTS5's unicode61 keeps as tokens
_FTS = ("CREATE VIRTUAL TABLE facts_fts USING fts5(text, tags, "
        "tokenize = 'porter unicode61 remove_diacritics 2')")
Entry = tuple[int, str, tuple[str, ...]]   # (fact id, text, tags)


@functools.lru_cache(maxsize=None)
def fts5_available() -> bool:
    """Whether this Python's SQLite library has FTS5 (a property of the build, probed once)."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE VIRTUAL TABLE probe USING fts5(x)")
        return True
    except sqlite3.Error:
        return False
    finally:
        conn.close()


def query_terms(query: str) -> list[str]:
    """The query's distinct words, case-folded (at most MAX_QUERY_TERMS). Only letters and digits
    survive, so no FTS5 syntax (quotes, AND/OR/NOT/NEAR as operators, *, :, ^, parentheses) can."""
    return list(dict.fromkeys(w.casefold() for w in _WORD.findall(query)))[:MAX_QUERY_TERMS]


class FactSearch:
    """The lexical index of one store's facts. `load` gives every sound fact (id, text, tags)."""

    def __init__(self, load: Callable[[], Iterable[Entry]]):
        self._load, self._lock = load, threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._entries: dict[int, Entry] = {}
        self.generation: int | None = None      # the store generation the index reflects

    def search(self, query: str, k: int, generation: int) -> list[tuple[int, float]]:
        """Up to k (fact id, score), best first (higher is better)."""
        terms = query_terms(query)
        if not terms or k <= 0:
            return []
        with self._lock:
            if generation != self.generation:
                self._rebuild()
                self.generation = generation
            if self._db is None:
                return self._scan(terms, k)
            match = " OR ".join(f'"{t}"' for t in terms)  # each a quoted string: never an operator
            rows = self._db.execute("SELECT rowid, bm25(facts_fts) FROM facts_fts WHERE facts_fts MATCH ? "
                                    "ORDER BY 2, 1 LIMIT ?", (match, k)).fetchall()
        return [(int(i), -float(score)) for i, score in rows]

    def changed(self, before: int, after: int, put: Entry | None = None, drop: int | None = None) -> None:
        """This process wrote one fact (put or drop) and moved the generation from before to after:
        apply it when the index reflected `before` and nothing else was written, else rebuild later."""
        with self._lock:
            if self.generation is None:
                return                              # not built yet: built whole on the first search
            if self.generation != before or after != before + 1:
                self.generation = None
                return
            if drop is not None:
                self._remove(drop)
            if put is not None:
                self._remove(put[0])
                self._add([put])
            self.generation = after

    def _rebuild(self) -> None:
        if self._db is not None:
            self._db.close()
        self._db, self._entries = None, {}
        entries = list(self._load())
        if fts5_available():
            self._db = sqlite3.connect(":memory:", check_same_thread=False)
            self._db.execute(_FTS)
        self._add(entries)

    def _add(self, entries: list[Entry]) -> None:
        for e in entries:
            self._entries[e[0]] = e
        if self._db is not None:
            self._db.executemany("INSERT INTO facts_fts(rowid, text, tags) VALUES (?, ?, ?)",
                                 [(i, text, " ".join(tags)) for i, text, tags in entries])

    def _remove(self, fact_id: int) -> None:
        if self._entries.pop(fact_id, None) is not None and self._db is not None:
            self._db.execute("DELETE FROM facts_fts WHERE rowid = ?", (fact_id,))

    def _scan(self, terms: list[str], k: int) -> list[tuple[int, float]]:
        scored = []
        for fid, text, tags in self._entries.values():
            words = Counter(w.casefold() for w in _WORD.findall(text + " " + " ".join(tags)))
            score = sum(1.0 + math.log(words[t]) for t in terms if words[t])
            if score:
                scored.append((fid, score))
        scored.sort(key=lambda item: (-item[1], item[0]))
        return scored[:k]
