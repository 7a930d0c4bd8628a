"""index.sqlite before a connection is made: the checks at open (no links, a creation a crash cut
short, a pending rollback journal, a whole header), a new index created whole or never there, and
the connection with the store's pragmas. The schema itself is the caller's (Index, schema.py).

Threading: called from Index.open only (the store's LOCK held, no other user of the index).
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Callable

from ..errors import StoreError
from . import fsafe
from .errors import IndexCorrupt, StoreIOError
from .schema import SCHEMA_VERSION
from .sqlitefile import COMPANIONS, check_sqlite_header, hot_journal, roll_back

Build = Callable[[sqlite3.Connection, Path], None]   # (connection, file): create the schema in it


def damaged(path: Path) -> str:
    return (f"the store's index {path} is damaged or missing while segment files exist, so its "
            f"epochs cannot be found or trusted; nothing was changed. Keep a copy of the folder "
            f"(or move it away to start a new store)")


def prepare(path: Path, *, create: bool, segments_exist: bool, build: Build) -> None:
    """Check index.sqlite and its companions before connecting; create it (build) when it is new."""
    for suffix in ("",) + COMPANIONS:  # SQLite cannot take O_NOFOLLOW for these: look first
        fsafe.check_entry(path.with_name(path.name + suffix))
    fsafe.discard_temp(path)            # a creation a crash cut short: it never was the index
    if hot_journal(path):
        roll_back(path)                # the checks below see the last commit, as SQLite does
    fresh = not path.exists() or path.stat().st_size == 0
    if fresh and segments_exist:
        raise IndexCorrupt(damaged(path))
    if fresh and not create:
        raise StoreError(f"no capsule store at {path.parent} (pass create=True to make one)")
    if fresh:
        _create(path, build)   # 0600 like its temporary file: WAL/SHM inherit the mode
    else:
        check_sqlite_header(path)
    os.chmod(path, 0o600)


def connect(path: Path) -> sqlite3.Connection:
    """One connection, usable from any thread (the Store serializes it), no implicit transactions."""
    return sqlite3.connect(fsafe.sqlite_uri(path), uri=True, isolation_level=None,
                           check_same_thread=False, timeout=30)


def configure(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode=WAL").fetchall()
    conn.execute("PRAGMA synchronous=FULL")
    # keep the WAL small on a robot's flash: checkpoint every 256 pages (1 MiB), and
    # truncate the file back to 1 MiB after a checkpoint instead of keeping its peak
    conn.execute("PRAGMA wal_autocheckpoint=256")
    conn.execute("PRAGMA journal_size_limit=1048576")


def _create(path: Path, build: Build) -> None:
    """A new index, whole or never there: the schema and schema_version are built in a temporary
    file which is fsynced and renamed over `path` (fsafe.create_by_rename). The companions of the
    empty file it replaces go first: SQLite would apply a stale -wal or -journal to the new file."""
    for suffix in COMPANIONS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.with_name(path.name + suffix))

    def fill(tmp: Path) -> None:
        conn = connect(tmp)
        try:  # no journal, no syncs: a crash leaves only the temporary file, never the index
            conn.execute("PRAGMA journal_mode=OFF").fetchall()
            conn.execute("PRAGMA synchronous=OFF")
            build(conn, tmp)
            conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
        finally:
            conn.close()
    try:
        fsafe.create_by_rename(path, fill)
    except (OSError, sqlite3.Error) as exc:  # e.g. a full disk
        raise StoreIOError(f"creating the index {path} failed: {exc}; nothing was created, free space "
                           f"or fix the disk and open again") from exc
