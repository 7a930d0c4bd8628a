"""index.sqlite's keyed-record tables (created at open when missing) and every query on them.

A keyed record is one `records` row (its collection, id, version, row JSON, record location and
an optional index-only cache blob) and one KIND_RECORD record in the segment log. A forgotten one
leaves a `forgotten` row pointing at its KIND_FORGET record, kept live so a rebuilt index forgets
it too. `record_ids` keeps each collection's highest id ever used: ids are never reused.
Functions take an Index (reads) or the connection of an open transaction (writes).
"""
from __future__ import annotations

import json
import sqlite3
from typing import TYPE_CHECKING, Any

from .info import PageRef
from .keyedrows import Collection, StoredRow, any_row_damage, read_row
from .records import KIND_FORGET, KIND_RECORD

if TYPE_CHECKING:
    from .index import Index

_IDS_PER_QUERY = 500            # stay far below SQLite's limit on bound parameters
SCHEMA = (
    'CREATE TABLE IF NOT EXISTS "records" ("collection" TEXT NOT NULL, "id" INTEGER NOT NULL, '
    '"version" INTEGER NOT NULL, "row" TEXT NOT NULL, "segment" INTEGER NOT NULL, "offset" INTEGER NOT NULL, '
    '"length" INTEGER NOT NULL, "cache" BLOB, PRIMARY KEY ("collection", "id"))',
    'CREATE INDEX IF NOT EXISTS "idx_records_segment_offset" ON "records" ("segment", "offset")',
    'CREATE TABLE IF NOT EXISTS "forgotten" ("collection" TEXT NOT NULL, "id" INTEGER NOT NULL, '
    '"segment" INTEGER NOT NULL, "offset" INTEGER NOT NULL, "length" INTEGER NOT NULL, '
    'PRIMARY KEY ("collection", "id"))',
    'CREATE TABLE IF NOT EXISTS "record_ids" ("collection" TEXT PRIMARY KEY, "top" INTEGER NOT NULL)',
)
_ROW = 'id, version, typeof("row"), CAST("row" AS BLOB)'   # the row read as bytes: one bad row must not fail a query


def has_tables(c: sqlite3.Connection) -> bool:
    names = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()}
    return {"records", "forgotten", "record_ids"} <= names


def create_schema(c: sqlite3.Connection) -> None:
    for sql in SCHEMA:
        c.execute(sql)


def row_json(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


# -- writes (inside a transaction) ------------------------------------------------------------------
def put(c: sqlite3.Connection, collection: str, rid: int, row: dict[str, Any], ref: PageRef,
        cache: bytes | None = None) -> None:
    """Insert or replace the record's row (a replaced row keeps its cache unless one is given)."""
    if c.execute("SELECT 1 FROM records WHERE collection = ? AND id = ?", (collection, rid)).fetchall():
        c.execute("UPDATE records SET version = ?, row = ?, segment = ?, offset = ?, length = ? "
                  "WHERE collection = ? AND id = ?",
                  (ref.rec_epoch, row_json(row), ref.segment, ref.offset, ref.length, collection, rid))
        if cache is not None:
            set_cache(c, collection, rid, cache)
    else:
        c.execute("INSERT INTO records VALUES (?,?,?,?,?,?,?,?)", (collection, rid, ref.rec_epoch, row_json(row),
                                                                  ref.segment, ref.offset, ref.length, cache))
    raise_top(c, collection, rid)


def raise_top(c: sqlite3.Connection, collection: str, rid: int) -> None:
    c.execute("INSERT INTO record_ids(collection, top) VALUES (?, ?) ON CONFLICT(collection) "
              "DO UPDATE SET top = MAX(top, excluded.top)", (collection, rid))


def set_cache(c: sqlite3.Connection, collection: str, rid: int, cache: bytes | None) -> None:
    c.execute("UPDATE records SET cache = ? WHERE collection = ? AND id = ?", (cache, collection, rid))


def forget(c: sqlite3.Connection, collection: str, rid: int, record: PageRef) -> None:
    """Delete the record's row and keep its forget record live (compaction must not drop it)."""
    c.execute("DELETE FROM records WHERE collection = ? AND id = ?", (collection, rid))
    c.execute("INSERT OR REPLACE INTO forgotten VALUES (?, ?, ?, ?, ?)",
              (collection, rid, record.segment, record.offset, record.length))
    raise_top(c, collection, rid)


# -- reads ----------------------------------------------------------------------------------------
def next_id(index: Index, collection: str) -> int:
    """Never a used id: the high-water mark survives deleting the newest row."""
    found = index.query("SELECT MAX(COALESCE((SELECT top FROM record_ids WHERE collection = ?), 0), "
                        "COALESCE((SELECT MAX(id) FROM records WHERE collection = ?), 0), "
                        "COALESCE((SELECT MAX(id) FROM forgotten WHERE collection = ?), 0))", (collection,) * 3)
    top = found[0][0]
    return (top if isinstance(top, int) and not isinstance(top, bool) and top >= 0 else 0) + 1


def exists(index: Index, collection: str, rid: int) -> bool:
    return bool(index.query("SELECT 1 FROM records WHERE collection = ? AND id = ?", (collection, rid)))


def stored(index: Index, coll: Collection, ids: list[int] | None) -> list[StoredRow]:
    """Rows of ids (all: None) ordered by id, every one checked (damaged ones flagged)."""
    if ids is None:
        found = index.query(f"SELECT {_ROW} FROM records WHERE collection = ? ORDER BY id", (coll.name,))
    else:
        wanted, found = sorted(set(ids)), []
        for i in range(0, len(wanted), _IDS_PER_QUERY):
            chunk = wanted[i:i + _IDS_PER_QUERY]
            found += index.query(f"SELECT {_ROW} FROM records WHERE collection = ? AND id IN "
                                 f"({','.join('?' * len(chunk))}) ORDER BY id", [coll.name, *chunk])
    return [read_row(coll, *r) for r in found]


def location(index: Index, collection: str, rid: int) -> PageRef | None:
    """Where the record's current version lies (fields that are not ints become None, so
    check_ref rejects the ref as damage, never a TypeError); None when there is no such row."""
    found = index.query("SELECT version, segment, offset, length FROM records WHERE collection = ? AND id = ?",
                        (collection, rid))
    return _ref(collection, rid, *found[0]) if found else None


def locations(index: Index) -> list[PageRef]:
    """Every record's location, by collection and id (verify)."""
    return [_ref(coll, rid, *rest) for coll, rid, *rest in index.query(
        "SELECT collection, id, version, segment, offset, length FROM records ORDER BY collection, id")]


def _ref(collection: Any, rid: Any, version: Any, segment: Any, offset: Any, length: Any) -> PageRef:
    def num(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    return PageRef(collection if isinstance(collection, str) else "?", num(rid), num(version) or 0, num(segment),
                   num(offset), num(length), KIND_RECORD)


def forget_ref(collection: str, rid: int, rec_epoch: int, segment: int, offset: int, length: int) -> PageRef:
    return PageRef(collection, rid, rec_epoch, segment, offset, length, KIND_FORGET)


def row_damage(index: Index) -> list[tuple[str, int, str]]:
    """(collection, id, why) of every row that is not a bounded JSON object (verify; the columns'
    types are the caller's to check, it alone knows them)."""
    out = []
    for coll, rid, row_type, raw in index.query('SELECT collection, id, typeof("row"), CAST("row" AS BLOB) '
                                                "FROM records ORDER BY collection, id"):
        why = any_row_damage(row_type, raw)
        if why:
            out.append((str(coll), rid, why))
    return out


def caches(index: Index, collection: str) -> list[tuple[int, bytes]]:
    found = index.query("SELECT id, cache FROM records WHERE collection = ? AND typeof(cache) = 'blob' "
                        "ORDER BY id", (collection,))
    return [(rid, bytes(blob)) for rid, blob in found if isinstance(rid, int) and isinstance(blob, bytes)]


def count(index: Index, collection: str | None = None) -> int:
    if collection is None:
        return int(index.query("SELECT COUNT(*) FROM records")[0][0])
    return int(index.query("SELECT COUNT(*) FROM records WHERE collection = ?", (collection,))[0][0])


def describe(index: Index, collection: str) -> str:
    """For error messages: what the store holds of the collection."""
    n, top = index.query("SELECT COUNT(*), MAX(id) FROM records WHERE collection = ?", (collection,))[0]
    return f"it holds {n} {collection} record(s), highest id {top}" if n else f"it holds no {collection} records"
