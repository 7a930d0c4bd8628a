"""index.sqlite's fact tables: their schema (created at open when missing) and every fact query.

A fact is one `facts` row, one KIND_FACT record (its KV, in the segment log) and, when SQLite has
FTS5, one `facts_fts` row with the same rowid (text and tags, for BM25 search). Writers change
the row and the FTS row in the same transaction. Functions here take an Index (reads) or the
connection of an open transaction (writes); the Store calls them under its state lock.
"""
from __future__ import annotations

import functools
import json
import math
import re
import sqlite3
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from ..errors import StoreError
from .factrows import ROW_COLUMNS, FactRow, from_sql, info, lenient_tags, sound
from .info import FactInfo, PageRef
from .records import FACT_REGION, FACTS_FORMAT_VERSION, KIND_FACT

if TYPE_CHECKING:
    from .index import Index

MAX_QUERY_TERMS = 64
_WORD = re.compile(r"[^\W_]+")  # runs of letters / digits: what FTS5's unicode61 keeps as tokens
_IDS_PER_QUERY = 500            # stay far below SQLite's limit on bound parameters
_SCHEMA = (
    'CREATE TABLE IF NOT EXISTS "facts" ("id" INTEGER PRIMARY KEY AUTOINCREMENT, "text" TEXT NOT NULL, '
    '"tags" TEXT NOT NULL, "n_tokens" INTEGER NOT NULL, "fingerprint" TEXT NOT NULL, "rope" TEXT NOT NULL, '
    '"created" REAL NOT NULL, "kv_version" INTEGER NOT NULL, "kv_segment" INTEGER NOT NULL, '
    '"kv_offset" INTEGER NOT NULL, "kv_length" INTEGER NOT NULL, "embedder" TEXT, "embedding" BLOB)',
    'CREATE INDEX IF NOT EXISTS "idx_facts_kv_segment_kv_offset" ON "facts" ("kv_segment", "kv_offset")',
    # one KIND_FORGET record per forgotten fact, kept live so a rebuilt index forgets it too
    'CREATE TABLE IF NOT EXISTS "forgets" ("id" INTEGER PRIMARY KEY, "segment" INTEGER NOT NULL, '
    '"offset" INTEGER NOT NULL, "length" INTEGER NOT NULL)',
)
_FTS = ('CREATE VIRTUAL TABLE "facts_fts" USING fts5("text", "tags", '
        "tokenize = 'porter unicode61 remove_diacritics 2')")


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


def _has_table(c: sqlite3.Connection, name: str) -> bool:
    return bool(c.execute("SELECT 1 FROM sqlite_master WHERE type IN ('table', 'view') AND name = ?",
                          (name,)).fetchall())


def _fts(c: sqlite3.Connection) -> bool:
    """Whether writes must keep facts_fts in step (it exists), and can (FTS5 is here)."""
    if not _has_table(c, "facts_fts"):
        return False
    if not fts5_available():
        raise StoreError("this store's facts_fts table needs SQLite's FTS5, which this Python's sqlite3 "
                         "lacks; write its facts from a Python whose SQLite has FTS5")
    return True


def needs_schema(c: sqlite3.Connection) -> bool:
    return (not _has_table(c, "facts") or not _has_table(c, "forgets")
            or (fts5_available() and not _has_table(c, "facts_fts")))


def create_schema(c: sqlite3.Connection) -> None:
    """Inside a transaction: the fact tables, where missing. An FTS table made late (the store was
    last written by a SQLite without FTS5) is filled from the rows already there."""
    for sql in _SCHEMA:
        c.execute(sql)
    if fts5_available() and not _has_table(c, "facts_fts"):
        c.execute(_FTS)
        rows = [from_sql(r) for r in c.execute(f"SELECT {ROW_COLUMNS} FROM facts").fetchall()]
        c.executemany("INSERT INTO facts_fts(rowid, text, tags) VALUES (?, ?, ?)",   # damaged: skipped on read
                      [(r.id, r.text if isinstance(r.text, str) else "", " ".join(lenient_tags(r.tags)))
                       for r in rows])


# -- writes (inside a transaction) ------------------------------------------------------------------
def insert(c: sqlite3.Connection, fact_id: int, text: str, tags: Sequence[str], n_tokens: int,
           fingerprint: str, rope: str, created: float, kv: PageRef, embedding: bytes | None,
           embedder: str | None) -> None:
    c.execute("INSERT INTO facts VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
              (fact_id, text, json.dumps(list(tags), ensure_ascii=False), n_tokens, fingerprint, rope, created,
               kv.rec_epoch, kv.segment, kv.offset, kv.length, embedder, embedding))
    if _fts(c):
        c.execute("INSERT INTO facts_fts(rowid, text, tags) VALUES (?, ?, ?)", (fact_id, text, " ".join(tags)))
    # readers that predate facts would compact fact records away as dead bytes: lock them out
    c.execute("UPDATE meta SET value = ? WHERE key = 'format_version' AND value = '1'",
              (str(FACTS_FORMAT_VERSION),))


def set_kv(c: sqlite3.Connection, fact_id: int, n_tokens: int, fingerprint: str, rope: str, kv: PageRef) -> None:
    c.execute("UPDATE facts SET n_tokens = ?, fingerprint = ?, rope = ?, kv_version = ?, kv_segment = ?, "
              "kv_offset = ?, kv_length = ? WHERE id = ?",
              (n_tokens, fingerprint, rope, kv.rec_epoch, kv.segment, kv.offset, kv.length, fact_id))


def set_embedding(c: sqlite3.Connection, fact_id: int, embedding: bytes | None, embedder: str | None) -> None:
    c.execute("UPDATE facts SET embedding = ?, embedder = ? WHERE id = ?", (embedding, embedder, fact_id))


def forget(c: sqlite3.Connection, fact_id: int, record: PageRef) -> None:
    """Delete the fact's rows and keep its forget record live (compaction must not drop it)."""
    c.execute("DELETE FROM facts WHERE id = ?", (fact_id,))
    if _fts(c):
        c.execute("DELETE FROM facts_fts WHERE rowid = ?", (fact_id,))
    c.execute("INSERT OR REPLACE INTO forgets(id, segment, offset, length) VALUES (?, ?, ?, ?)",
              (fact_id, record.segment, record.offset, record.length))


# -- reads ----------------------------------------------------------------------------------------
def next_id(index: Index) -> int:
    """Never a used id: AUTOINCREMENT's high-water mark survives deleting the newest row."""
    rows = index.query("SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'facts'), 0), "
                       "COALESCE((SELECT MAX(id) FROM facts), 0))")
    return int(rows[0][0]) + 1


def exists(index: Index, fact_id: int) -> bool:
    return bool(index.query("SELECT 1 FROM facts WHERE id = ?", (fact_id,)))


def row(index: Index, fact_id: int) -> FactRow | None:
    """The fact's row, unchecked (factrows.damage says whether it is sound)."""
    rows = index.query(f"SELECT {ROW_COLUMNS} FROM facts WHERE id = ?", (fact_id,))
    return from_sql(rows[0]) if rows else None


def rows(index: Index) -> list[FactRow]:
    """Every row, unchecked, ordered by id (verify)."""
    return [from_sql(r) for r in index.query(f"SELECT {ROW_COLUMNS} FROM facts ORDER BY id")]


def kv_refs(index: Index) -> list[PageRef]:
    return [_ref(*r) for r in index.query(
        "SELECT id, kv_version, kv_segment, kv_offset, kv_length FROM facts ORDER BY id")]


def ref_of(fact: FactRow) -> PageRef:
    return _ref(fact.id, fact.kv_version, fact.kv_segment, fact.kv_offset, fact.kv_length)


def _ref(fact_id: int, version: object, segment: object, offset: object, length: object) -> PageRef:
    """A location field that is not an int (damaged row) becomes None: check_ref then rejects the
    ref as "no location" (a RecordError), never a TypeError."""
    def num(v: object) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    return PageRef(FACT_REGION, fact_id, num(version) or 0, num(segment), num(offset), num(length), KIND_FACT)


def infos(index: Index, ids: list[int] | None) -> list[FactInfo]:
    """Sound facts of ids (all: None), ordered by id; a damaged row is left out with a warning."""
    if ids is None:
        found = index.query(f"SELECT {ROW_COLUMNS} FROM facts ORDER BY id")
    else:
        wanted, found = sorted(set(ids)), []
        for i in range(0, len(wanted), _IDS_PER_QUERY):
            chunk = wanted[i:i + _IDS_PER_QUERY]
            found += index.query(f"SELECT {ROW_COLUMNS} FROM facts WHERE id IN ({','.join('?' * len(chunk))}) "
                                 "ORDER BY id", chunk)
    return [info(r) for r in sound(found)]


def embeddings(index: Index) -> list[tuple[int, str, bytes]]:
    found = index.query(f"SELECT {ROW_COLUMNS}, embedding FROM facts WHERE embedding IS NOT NULL ORDER BY id")
    blobs = {r[0]: r[-1] for r in found}
    return [(r.id, r.embedder, bytes(blobs[r.id])) for r in sound(found)]


def count(index: Index) -> int:
    return int(index.query("SELECT COUNT(*) FROM facts")[0][0])


def describe(index: Index) -> str:
    """For error messages: what the store holds."""
    n, top = index.query("SELECT COUNT(*), MAX(id) FROM facts")[0]
    return f"it holds {n} fact(s), highest id {top}" if n else "it holds no facts"


def query_terms(query: str) -> list[str]:
    """The query's distinct words, case-folded (at most MAX_QUERY_TERMS). Only letters and digits
    survive, so no FTS5 syntax (quotes, AND/OR/NOT/NEAR as operators, *, :, ^, parentheses) can."""
    return list(dict.fromkeys(w.casefold() for w in _WORD.findall(query)))[:MAX_QUERY_TERMS]


def search(index: Index, query: str, k: int) -> list[tuple[int, float]]:
    terms = query_terms(query)
    if not terms or k <= 0:
        return []
    if not fts5_available() or not index.query("SELECT 1 FROM sqlite_master WHERE name = 'facts_fts'"):
        return _scan(index, terms, k)
    match = " OR ".join(f'"{t}"' for t in terms)  # each a quoted string: never an operator
    rows = index.query("SELECT rowid, bm25(facts_fts) FROM facts_fts WHERE facts_fts MATCH ? "
                       "ORDER BY 2, 1 LIMIT ?", (match, k))
    return [(int(i), -float(score)) for i, score in rows]


def _scan(index: Index, terms: list[str], k: int) -> list[tuple[int, float]]:
    """Without FTS5: score = sum over query terms found of 1 + ln(occurrences) in text + tags
    (whole words, case-folded, no stemming); a full scan, fine for thousands of facts."""
    scored = []
    for r in sound(index.query(f"SELECT {ROW_COLUMNS} FROM facts")):
        words = Counter(w.casefold() for w in _WORD.findall(r.text + " " + " ".join(info(r).tags)))
        score = sum(1.0 + math.log(words[t]) for t in terms if words[t])
        if score:
            scored.append((r.id, score))
    scored.sort(key=lambda item: (-item[1], item[0]))
    return scored[:k]


def fts_problems(index: Index) -> list[str]:
    """verify(): the FTS table holds exactly one row per fact, and its own structure checks out."""
    if not fts5_available() or not index.query("SELECT 1 FROM sqlite_master WHERE name = 'facts_fts'"):
        return []
    missing = index.query("SELECT COUNT(*) FROM (SELECT id FROM facts EXCEPT SELECT rowid FROM facts_fts)")
    extra = index.query("SELECT COUNT(*) FROM (SELECT rowid FROM facts_fts EXCEPT SELECT id FROM facts)")
    problems = [f"index: {n} {what} (rebuild facts_fts)" for n, what in
                ((missing[0][0], "facts missing from facts_fts"), (extra[0][0], "facts_fts rows without a fact"))
                if n]
    try:
        index.write("checking facts_fts", lambda c: c.execute(
            "INSERT INTO facts_fts(facts_fts) VALUES ('integrity-check')"))
    except StoreError as exc:  # IndexCorrupt / StoreIOError: reported, not raised
        problems.append(f"index: facts_fts integrity check failed: {exc}")
    return problems
