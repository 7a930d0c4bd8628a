"""The epoch and page-map SQL a writer runs inside one index transaction (index.py owns the
connection, the transactions and the reads): epoch rows and the page rows they supersede, the
segments' committed ends and the log's head, retention's dead rows, compaction's moves.

Threading: the caller holds the Store's state lock and an open transaction on `c`.
"""
from __future__ import annotations

import bisect
import json
import sqlite3

from . import rows
from .info import Head, StagedEpoch

EPOCH_COLS = "id, name, created, bytes_written, n_pages, meta, base"


def insert_epochs(c: sqlite3.Connection, staged: list[StagedEpoch]) -> None:
    """Inside a transaction: the epoch rows and page rows of staged epochs, oldest first."""
    for st in staged:
        e, m = st.info, st.manifest
        c.execute(f"INSERT INTO epochs({EPOCH_COLS}, man_segment, man_offset, man_length) "
                  "VALUES (?,?,?,?,?,?,?,?,?,?)",
                  (e.id, e.name, e.created, e.bytes_written, e.n_pages, json.dumps(e.meta), e.base,
                   m.segment, m.offset, m.length))
        c.executemany("UPDATE pages SET superseded = ? WHERE region = ? AND idx = ? "
                      "AND superseded IS NULL", [(e.id, r.region, r.index) for r in st.rows])
        c.executemany("INSERT INTO pages VALUES (?,?,?,?,?,?,?,NULL)",
                      [(r.region, r.index, e.id, r.rec_epoch, r.segment, r.offset, r.length) for r in st.rows])


def set_ends(c: sqlite3.Connection, ends: dict[int, int], head: Head | None = None) -> None:
    """Inside a transaction: the segments' new committed ends and the log's new head."""
    c.executemany("INSERT INTO segments(id, committed_end, state) VALUES (?, ?, 'live') ON CONFLICT(id) "
                  "DO UPDATE SET committed_end = excluded.committed_end", ends.items())
    if head is not None:
        c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('head', ?)", (rows.head_text(head),))


def drop_epochs(c: sqlite3.Connection, dropped: list[int]) -> None:
    """Delete epochs and every page row no remaining epoch can see. Row (r, i, e) superseded at s
    is seen by epochs [e, s): only rows whose range holds a dropped epoch can die, and those were
    superseded after min(dropped) (a small set)."""
    c.executemany("DELETE FROM epochs WHERE id = ?", [(e,) for e in dropped])
    kept = [r[0] for r in c.execute("SELECT id FROM epochs ORDER BY id")]
    found = c.execute("SELECT region, idx, epoch, superseded FROM pages "
                      "WHERE superseded > ? AND epoch <= ?", (min(dropped), max(dropped))).fetchall()
    dead = [(r, i, e) for r, i, e, s in found if not _any_between(kept, e, s)]
    c.executemany("DELETE FROM pages WHERE region = ? AND idx = ? AND epoch = ?", dead)
    for region, idx in {(r, i) for r, i, _ in dead}:
        # a tombstone with nothing older to hide is useless
        c.execute("DELETE FROM pages WHERE region = ? AND idx = ? AND segment IS NULL AND epoch = "
                  "(SELECT MIN(epoch) FROM pages WHERE region = ? AND idx = ?)",
                  (region, idx, region, idx))


def repoint(c: sqlite3.Connection, moves: dict[tuple[int, int], tuple[int, int]]) -> None:
    """Compaction: every row pointing at a moved record (segment, offset) follows it."""
    for (seg, off), (nseg, noff) in moves.items():
        c.execute("UPDATE pages SET segment = ?, offset = ? WHERE segment = ? AND offset = ?",
                  (nseg, noff, seg, off))
        c.execute("UPDATE epochs SET man_segment = ?, man_offset = ? "
                  "WHERE man_segment = ? AND man_offset = ?", (nseg, noff, seg, off))
        for table in ("records", "forgotten"):
            c.execute(f"UPDATE {table} SET segment = ?, offset = ? WHERE segment = ? AND offset = ?",
                      (nseg, noff, seg, off))


def _any_between(sorted_ids: list[int], lo: int, hi: int | None) -> bool:
    """Is some id in [lo, hi) (hi None: unbounded)?"""
    i = bisect.bisect_left(sorted_ids, lo)
    return i < len(sorted_ids) and (hi is None or sorted_ids[i] < hi)
