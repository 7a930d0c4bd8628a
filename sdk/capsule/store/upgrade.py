"""Upgrading an index of format 1..3 to format 4 in place, at open (docs/FORMAT.md, "Index").

Format 3 kept its only kind of keyed record (region "fact") in its own tables: `facts` (a row's
columns, then the record location kv_version / kv_segment / kv_offset / kv_length, then cache
columns), `forgets` (id, location) and `facts_fts`. Format 4 keeps every collection in `records`,
`forgotten` and `record_ids`. The segment log is not touched: its bytes are the same in both.
Each row is taken from its record's head where the record holds one (the log is the truth),
else (a record written before format 3) from the old columns between `id` and `kv_version`, as
stored. Cache columns are dropped: the caller recomputes its caches. One transaction: a crash
leaves the old index, and the next open upgrades again.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from . import keyeddb, keyedrecord
from .index import Index
from .info import PageRef
from .reader import check_record, check_ref
from .records import KIND_RECORD, STORE_FORMAT_VERSION, RecordError, Sealer
from .segments import SegmentReader

LEGACY_COLLECTION = "fact"          # the region of every kind-3 record before format 4
_LOCATION = ("kv_version", "kv_segment", "kv_offset", "kv_length")


def upgrade(index: Index, seg_dir: Path, sealer: Sealer, store_id: str, meta: dict[str, str]) -> dict[str, str]:
    """The meta values written; the legacy tables are moved into the generic ones and dropped."""
    values = {"format_version": str(STORE_FORMAT_VERSION)}
    if meta.get("format_version") in ("1", "2"):
        # its epochs so far have bare manifests; from now on the log describes itself
        values["legacy_until"] = str(index.latest() or 0)
    tables = {r[0] for r in index.query("SELECT name FROM sqlite_master WHERE type = 'table'")}
    with SegmentReader(seg_dir, sealer.signed) as segs:
        moved = _legacy_rows(index, segs, sealer, store_id) if "facts" in tables else []
    forgets = index.query("SELECT id, segment, offset, length FROM forgets") if "forgets" in tables else []
    seq = index.query("SELECT seq FROM sqlite_sequence WHERE name = 'facts'") \
        if "sqlite_sequence" in tables else []

    def apply(c: sqlite3.Connection) -> None:
        for rid, row, ref in moved:
            keyeddb.put(c, LEGACY_COLLECTION, rid, row, ref)
        for rid, seg, off, length in forgets:
            c.execute("INSERT OR REPLACE INTO forgotten VALUES (?, ?, ?, ?, ?)", (LEGACY_COLLECTION, rid, seg, off,
                                                                                  length))
            keyeddb.raise_top(c, LEGACY_COLLECTION, rid)
        if seq and isinstance(seq[0][0], int):
            keyeddb.raise_top(c, LEGACY_COLLECTION, seq[0][0])   # ids never reused
        for table in ("facts_fts", "facts", "forgets"):
            if table in tables or table == "facts_fts":
                try:
                    c.execute(f'DROP TABLE IF EXISTS "{table}"')
                except sqlite3.OperationalError:
                    pass            # an FTS table this SQLite cannot load: left, never read again
        c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", values.items())
    index.write("upgrading the index to format 4", apply)
    return values


def _legacy_rows(index: Index, segs: SegmentReader, sealer: Sealer,
                 store_id: str) -> list[tuple[Any, dict[str, Any], PageRef]]:
    columns = [r[1] for r in index.query("SELECT * FROM pragma_table_info('facts') ORDER BY cid")]
    if "id" not in columns or not set(_LOCATION) <= set(columns):
        return []
    first, last = columns.index("id") + 1, columns.index("kv_version")
    names = columns[first:last]
    out = []
    for found in index.query("SELECT * FROM facts ORDER BY id"):
        values = dict(zip(columns, found))
        ref = PageRef(LEGACY_COLLECTION, values["id"], *(values[c] for c in _LOCATION), KIND_RECORD)
        row = _head_row(segs, sealer, ref, store_id)
        if row is None:
            row = {n: _legacy_value(values[n]) for n in names}
        out.append((values["id"], row, ref))
    return out


def _legacy_value(value: Any) -> Any:
    """An old column's value as a row holds it: a list column was kept as JSON text there."""
    if isinstance(value, str) and value.startswith("["):
        try:
            doc = json.loads(value)
        except ValueError:
            return value
        if isinstance(doc, list) and all(isinstance(v, str) for v in doc):
            return doc
    return value if isinstance(value, (str, int, float, type(None))) else None


def _head_row(segs: SegmentReader, sealer: Sealer, ref: PageRef, store_id: str) -> dict[str, Any] | None:
    """The row the record holds (None: headless, damaged, or another store's)."""
    try:
        check_ref(ref)
        head, _ = keyedrecord.decode(check_record(segs.view(ref.segment, ref.offset, ref.length),  # type: ignore
                                                  ref, sealer))
    except (RecordError, TypeError):
        return None
    return head.row if head is not None and head.store_id == store_id else None
