"""index.sqlite: the connection, its transactions and guard, and every query the store makes.
The file's checks at open and its creation: indexfile.py; a writer's epoch / page-map SQL: pagemap.py.

Threading: one connection (check_same_thread=False); the Store calls it only under its state
lock. Transactions are explicit (BEGIN IMMEDIATE ... COMMIT); nothing commits implicitly.
"""
from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Callable, Iterable, Iterator

from . import indexfile, keyeddb, pagemap, rows, schema
from .errors import IndexCorrupt, StoreIOError
from .info import EpochInfo, Head, PageRef, StagedEpoch
from .pagemap import EPOCH_COLS
from .rows import RowError
from .schema import SCHEMA_VERSION
from .sqlitefile import is_corruption

# (table, segment, offset, length columns, filter): where rows point at records
_LOCATIONS = (("pages", "segment", "offset", "length", " WHERE segment IS NOT NULL"),
              ("epochs", "man_segment", "man_offset", "man_length", ""),
              ("records", "segment", "offset", "length", ""),
              ("forgotten", "segment", "offset", "length", ""))


class Index:
    """The page map and epoch list. See docs/FORMAT.md for the schema."""

    def __init__(self, path: Path, conn: sqlite3.Connection):
        self.path, self._conn = path, conn

    @classmethod
    def open(cls, path: Path, *, create: bool, segments_exist: bool) -> "Index":
        indexfile.prepare(path, create=create, segments_exist=segments_exist,
                          build=lambda conn, tmp: Index(tmp, conn)._create_schema())
        conn = indexfile.connect(path)
        index = cls(path, conn)
        try:
            with index._guard("opening"):
                indexfile.configure(conn)
                if not index._initialized():
                    if segments_exist:
                        raise IndexCorrupt(indexfile.damaged(path))
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
                pagemap.set_ends(c, ends, head)

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
            return [rows.epoch_info(r) for r in self._query(f"SELECT {EPOCH_COLS} FROM epochs {where} "
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
            pagemap.insert_epochs(c, staged)
            pagemap.set_ends(c, ends, head)

    @staticmethod
    def set_ends(c: sqlite3.Connection, ends: dict[int, int], head: Head | None = None) -> None:
        """Inside a transaction: the segments' new committed ends and the log's new head."""
        pagemap.set_ends(c, ends, head)

    # -- retention ------------------------------------------------------------------------------
    def drop_epochs(self, dropped: list[int]) -> None:
        """Delete epochs and every page row no remaining epoch can see, in one transaction."""
        with self.transaction("dropping old epochs") as c:
            pagemap.drop_epochs(c, dropped)

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
            pagemap.repoint(c, moves)
            pagemap.set_ends(c, ends, head)
            c.executemany("UPDATE segments SET state = 'dead' WHERE id = ?", [(s,) for s in dead])

    def forget_segments(self, ids: list[int]) -> None:
        with self.transaction("forgetting deleted segments") as c:
            c.executemany("DELETE FROM segments WHERE id = ? AND state = 'dead'", [(s,) for s in ids])

    def integrity_problems(self) -> list[str]:
        rows = self._query("PRAGMA integrity_check")
        return [] if rows == [("ok",)] else [f"index: {r[0]}" for r in rows]


def _schema_damage(exc: sqlite3.Error) -> bool:
    text = str(exc)
    return "decode" in text or "no such column" in text or "no such table" in text or "has no column" in text
