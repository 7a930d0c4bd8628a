"""index.sqlite: schema, integrity checks at open, and every query the store makes.

Threading: one connection (check_same_thread=False); the Store calls it only under its state
lock. Transactions are explicit (BEGIN IMMEDIATE ... COMMIT); nothing commits implicitly.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import StoreError
from . import keyeddb, rows, schema
from . import fsafe
from .errors import IndexCorrupt, StoreIOError
from .info import EpochInfo, Head, PageRef, StagedEpoch
from .rows import RowError
from .sqlitefile import COMPANIONS, check_sqlite_header, hot_journal, is_corruption, roll_back

SCHEMA_VERSION = 1
_EPOCH_COLS = "id, name, created, bytes_written, n_pages, meta, base"
# (table, segment, offset, length columns, filter): where rows point at records
_LOCATIONS = (("pages", "segment", "offset", "length", " WHERE segment IS NOT NULL"),
              ("epochs", "man_segment", "man_offset", "man_length", ""),
              ("records", "segment", "offset", "length", ""),
              ("forgotten", "segment", "offset", "length", ""))


def _create(path: Path) -> None:
    """A new index, whole or never there: the schema and schema_version are built in a temporary
    file which is fsynced and renamed over `path` (fsafe.create_by_rename). The companions of the
    empty file it replaces go first: SQLite would apply a stale -wal or -journal to the new file."""
    for suffix in COMPANIONS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.with_name(path.name + suffix))

    def build(tmp: Path) -> None:
        conn = sqlite3.connect(fsafe.sqlite_uri(tmp), uri=True, isolation_level=None,
                               check_same_thread=False, timeout=30)
        try:  # no journal, no syncs: a crash leaves only the temporary file, never the index
            conn.execute("PRAGMA journal_mode=OFF").fetchall()
            conn.execute("PRAGMA synchronous=OFF")
            Index(tmp, conn)._create_schema()
            conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
        finally:
            conn.close()
    try:
        fsafe.create_by_rename(path, build)
    except (OSError, sqlite3.Error) as exc:  # e.g. a full disk
        raise StoreIOError(f"creating the index {path} failed: {exc}; nothing was created, free space "
                           f"or fix the disk and open again") from exc


class Index:
    """The page map and epoch list. See docs/FORMAT.md for the schema."""

    def __init__(self, path: Path, conn: sqlite3.Connection):
        self.path, self._conn = path, conn

    @classmethod
    def open(cls, path: Path, *, create: bool, segments_exist: bool) -> "Index":
        damaged = (f"the store's index {path} is damaged or missing while segment files exist, so its "
                   f"epochs cannot be found or trusted; nothing was changed. Keep a copy of the folder "
                   f"(or move it away to start a new store)")
        for suffix in ("",) + COMPANIONS:  # SQLite cannot take O_NOFOLLOW for these: look first
            fsafe.check_entry(path.with_name(path.name + suffix))
        fsafe.discard_temp(path)            # a creation a crash cut short: it never was the index
        if hot_journal(path):
            roll_back(path)                # the checks below see the last commit, as SQLite does
        fresh = not path.exists() or path.stat().st_size == 0
        if fresh and segments_exist:
            raise IndexCorrupt(damaged)
        if fresh and not create:
            raise StoreError(f"no capsule store at {path.parent} (pass create=True to make one)")
        if fresh:
            _create(path)   # 0600 like its temporary file: WAL/SHM inherit the mode
        else:
            check_sqlite_header(path)
        os.chmod(path, 0o600)
        conn = sqlite3.connect(fsafe.sqlite_uri(path), uri=True, isolation_level=None,
                               check_same_thread=False, timeout=30)
        index = cls(path, conn)
        try:
            with index._guard("opening"):
                conn.execute("PRAGMA journal_mode=WAL").fetchall()
                conn.execute("PRAGMA synchronous=FULL")
                # keep the WAL small on a robot's flash: checkpoint every 256 pages (1 MiB), and
                # truncate the file back to 1 MiB after a checkpoint instead of keeping its peak
                conn.execute("PRAGMA wal_autocheckpoint=256")
                conn.execute("PRAGMA journal_size_limit=1048576")
                if not index._initialized():
                    if segments_exist:
                        raise IndexCorrupt(damaged)
                    index._create_schema()
                elif not keyeddb.has_tables(conn):  # an older store: gains them (upgrade.py fills them)
                    with index.transaction("adding the keyed-record tables") as c:
                        keyeddb.create_schema(c)
        except BaseException:
            conn.close()
            raise
        return index

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            # a constraint failing on our own writes, text that is not UTF-8, or a table or column
            # of our own schema gone missing is damage too
            if is_corruption(exc) or isinstance(exc, sqlite3.IntegrityError) or _schema_damage(exc):
                raise IndexCorrupt(f"index {self.path} is damaged ({exc}) while {what}; "
                                   f"run `capsule verify` and keep a copy of the folder") from exc
            raise StoreIOError(f"index {self.path} failed while {what}: {exc}") from exc
        except (UnicodeDecodeError, RowError) as exc:
            raise IndexCorrupt(f"index {self.path} is damaged ({exc}) while {what}") from exc

    @contextlib.contextmanager
    def transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """One atomic transaction; rolled back (and re-raised as a store error) on any failure."""
        with self._guard(what):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: Iterable = ()) -> list[tuple]:
        with self._guard("reading"):
            return self._conn.execute(sql, tuple(args)).fetchall()

    query = _query  # for keyeddb, which keeps the keyed-record SQL out of this module

    def write(self, what: str, apply: Callable[[sqlite3.Connection], None],
              ends: dict[int, int] | None = None, head: Head | None = None) -> None:
        """One transaction running apply(conn), plus the segments' new committed ends and the
        log's new head if given."""
        with self.transaction(what) as c:
            apply(c)
            if ends:
                self._set_ends(c, ends, head)

    # -- schema / meta -------------------------------------------------------------------------
    def _initialized(self) -> bool:
        if not self._conn.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchall():
            return False
        return bool(self._conn.execute("SELECT 1 FROM meta WHERE key='schema_version'").fetchall())

    def _create_schema(self) -> None:
        with self.transaction("creating the index"):
            schema.create(self._conn)

    def get_meta(self) -> dict[str, str]:
        with self._guard("reading the store's metadata"):
            return rows.meta(self._query("SELECT key, value FROM meta"))

    def head(self) -> Head | None:
        """The last record committed to the log, as the index recorded it (None: an older store)."""
        with self._guard("reading the log head"):
            found = self._query("SELECT value FROM meta WHERE key = 'head'")
            return rows.head(found[0][0]) if found else None

    def init_meta(self, values: dict[str, str]) -> None:
        with self.transaction("initializing the store") as c:
            c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", values.items())
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                      (str(SCHEMA_VERSION),))

    # -- epochs -------------------------------------------------------------------------------
    def latest(self) -> int | None:
        with self._guard("reading the epochs"):
            return rows.opt_int(self._query("SELECT MAX(id) FROM epochs")[0][0], "epochs.id")

    def epochs(self, where: str = "", args: Iterable = ()) -> list[EpochInfo]:
        with self._guard("reading the epochs"):
            return [rows.epoch_info(r) for r in self._query(f"SELECT {_EPOCH_COLS} FROM epochs {where} "
                                                              f"ORDER BY id", args)]

    def epoch_ids(self) -> list[int]:
        with self._guard("reading the epochs"):
            return [rows.int_(r[0], "epochs.id") for r in self._query("SELECT id FROM epochs ORDER BY id")]

    def by_name(self, name: str) -> int | None:
        with self._guard("reading the epochs"):
            found = self._query("SELECT id FROM epochs WHERE name = ?", (name,))
            return rows.int_(found[0][0], "epochs.id") if found else None

    def manifest_ref(self, epoch: int) -> PageRef | None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 < epoch < 1 << 63:
            return None
        with self._guard("reading the epochs"):
            found = self._query("SELECT man_segment, man_offset, man_length FROM epochs WHERE id = ?", (epoch,))
            return rows.ref(None, None, epoch, *found[0]) if found else None

    def view(self, epoch: int) -> list[PageRef]:
        """The page records epoch sees: per (region, idx), the newest row at or before it,
        unless that row is a tombstone. (SQLite takes bare columns from the MAX() row.)"""
        with self._guard("reading the page map"):
            found = self._query("SELECT region, idx, MAX(epoch), rec_epoch, segment, offset, length FROM pages "
                                "WHERE epoch <= ? GROUP BY region, idx", (epoch,))
            return [rows.ref(r, i, re, s, o, n) for r, i, _, re, s, o, n in found if s is not None]

    def changed_after(self, epoch: int) -> set[tuple[str, int]]:
        with self._guard("reading the page map"):
            return {(rows.str_(r, "pages.region"), rows.int_(i, "pages.idx"))
                    for r, i in self._query("SELECT DISTINCT region, idx FROM pages WHERE epoch > ?", (epoch,))}

    def commit(self, staged: list[StagedEpoch], ends: dict[int, int], head: Head | None = None) -> None:
        """THE commit point: every staged epoch's rows and the segments' new ends, atomically."""
        with self.transaction("committing epochs") as c:
            insert_epochs(c, staged)
            self._set_ends(c, ends, head)

    @staticmethod
    def set_ends(c: sqlite3.Connection, ends: dict[int, int], head: Head | None = None) -> None:
        """Inside a transaction: the segments' new committed ends and the log's new head."""
        Index._set_ends(c, ends, head)

    @staticmethod
    def _set_ends(c: sqlite3.Connection, ends: dict[int, int], head: Head | None = None) -> None:
        c.executemany("INSERT INTO segments(id, committed_end, state) VALUES (?, ?, 'live') ON CONFLICT(id) "
                      "DO UPDATE SET committed_end = excluded.committed_end", ends.items())
        if head is not None:
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('head', ?)", (rows.head_text(head),))

    # -- retention ------------------------------------------------------------------------------
    def drop_epochs(self, dropped: list[int]) -> None:
        """Delete epochs and every page row no remaining epoch can see, in one transaction.
        Row (r, i, e) superseded at s is seen by epochs [e, s): only rows whose range holds a
        dropped epoch can die, and those were superseded after min(dropped) (a small set)."""
        with self.transaction("dropping old epochs") as c:
            c.executemany("DELETE FROM epochs WHERE id = ?", [(e,) for e in dropped])
            kept = [r[0] for r in c.execute("SELECT id FROM epochs ORDER BY id")]
            rows = c.execute("SELECT region, idx, epoch, superseded FROM pages "
                             "WHERE superseded > ? AND epoch <= ?", (min(dropped), max(dropped))).fetchall()
            dead = [(r, i, e) for r, i, e, s in rows if not _any_between(kept, e, s)]
            c.executemany("DELETE FROM pages WHERE region = ? AND idx = ? AND epoch = ?", dead)
            for region, idx in {(r, i) for r, i, _ in dead}:
                # a tombstone with nothing older to hide is useless
                c.execute("DELETE FROM pages WHERE region = ? AND idx = ? AND segment IS NULL AND epoch = "
                          "(SELECT MIN(epoch) FROM pages WHERE region = ? AND idx = ?)",
                          (region, idx, region, idx))

    # -- segments / compaction -----------------------------------------------------------------
    def segments(self, state: str = "live") -> dict[int, int]:
        with self._guard("reading the segment list"):
            return {rows.int_(i, "segments.id"): rows.int_(e, "segments.committed_end") for i, e in
                    self._query("SELECT id, committed_end FROM segments WHERE state = ? ORDER BY id", (state,))}

    def live_records(self, segment: int | None = None) -> list[tuple[int, int, int]]:
        """Distinct (segment, offset, length) of every record some row points at (pages,
        manifests, keyed records, forget records), in file order."""
        if segment is None:
            sql, args = " UNION ".join(f"SELECT {s}, {o}, {n} FROM {t}{f}" for t, s, o, n, f in _LOCATIONS), ()
        else:
            sql = " UNION ".join(f"SELECT {s}, {o}, {n} FROM {t} WHERE {s} = ?" for t, s, o, n, _ in _LOCATIONS)
            args = (segment,) * len(_LOCATIONS)
        with self._guard("reading the record locations"):
            found = self._query(sql + " ORDER BY 1, 2", args)
            return [(rows.int_(a, "segment", 1), rows.int_(b, "offset"), rows.int_(c, "length", 1)) for a, b, c in found]

    def repoint(self, moves: dict[tuple[int, int], tuple[int, int]], ends: dict[int, int],
                dead: list[int], head: Head | None = None) -> None:
        """Compaction's commit: rows follow their copied records; old segments become dead."""
        with self.transaction("committing compaction") as c:
            for (seg, off), (nseg, noff) in moves.items():
                c.execute("UPDATE pages SET segment = ?, offset = ? WHERE segment = ? AND offset = ?",
                          (nseg, noff, seg, off))
                c.execute("UPDATE epochs SET man_segment = ?, man_offset = ? "
                          "WHERE man_segment = ? AND man_offset = ?", (nseg, noff, seg, off))
                for table in ("records", "forgotten"):
                    c.execute(f"UPDATE {table} SET segment = ?, offset = ? WHERE segment = ? AND offset = ?",
                              (nseg, noff, seg, off))
            self._set_ends(c, ends, head)
            c.executemany("UPDATE segments SET state = 'dead' WHERE id = ?", [(s,) for s in dead])

    def forget_segments(self, ids: list[int]) -> None:
        with self.transaction("forgetting deleted segments") as c:
            c.executemany("DELETE FROM segments WHERE id = ? AND state = 'dead'", [(s,) for s in ids])

    def integrity_problems(self) -> list[str]:
        rows = self._query("PRAGMA integrity_check")
        return [] if rows == [("ok",)] else [f"index: {r[0]}" for r in rows]


def insert_epochs(c: sqlite3.Connection, staged: list[StagedEpoch]) -> None:
    """Inside a transaction: the epoch rows and page rows of staged epochs, oldest first."""
    for st in staged:
        e, m = st.info, st.manifest
        c.execute(f"INSERT INTO epochs({_EPOCH_COLS}, man_segment, man_offset, man_length) "
                  "VALUES (?,?,?,?,?,?,?,?,?,?)",
                  (e.id, e.name, e.created, e.bytes_written, e.n_pages, json.dumps(e.meta), e.base,
                   m.segment, m.offset, m.length))
        c.executemany("UPDATE pages SET superseded = ? WHERE region = ? AND idx = ? "
                      "AND superseded IS NULL", [(e.id, r.region, r.index) for r in st.rows])
        c.executemany("INSERT INTO pages VALUES (?,?,?,?,?,?,?,NULL)",
                      [(r.region, r.index, e.id, r.rec_epoch, r.segment, r.offset, r.length) for r in st.rows])


def _schema_damage(exc: sqlite3.Error) -> bool:
    text = str(exc)
    return "decode" in text or "no such column" in text or "no such table" in text or "has no column" in text


def _any_between(sorted_ids: list[int], lo: int, hi: int | None) -> bool:
    """Is some id in [lo, hi) (hi None: unbounded)?"""
    i = bisect.bisect_left(sorted_ids, lo)
    return i < len(sorted_ids) and (hi is None or sorted_ids[i] < hi)
