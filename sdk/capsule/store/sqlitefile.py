"""index.sqlite as a file: is it a whole SQLite database, is a rollback journal pending, and which
SQLite errors mean damage. O(1) checks made before and while the index is opened (index.py).
"""
from __future__ import annotations

import os
import sqlite3
import struct
from pathlib import Path

from . import fsafe
from .errors import IndexCorrupt, StoreIOError

_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


def check_sqlite_header(path: Path) -> None:
    """Cheap O(1) check that the file is a whole SQLite database (catches truncation), unless a
    hot journal or a WAL is pending: then a short or torn main file is SQLite's to repair."""
    if hot_journal(path):
        return  # a transaction cut by a crash: SQLite plays the journal back before reading
    fd = fsafe.open_regular(path, os.O_RDONLY)
    try:
        size, head = os.fstat(fd).st_size, os.pread(fd, 100, 0)
    finally:
        os.close(fd)
    if len(head) < 100 or not head.startswith(b"SQLite format 3\x00"):
        raise IndexCorrupt(f"{path} is not an SQLite database (garbage or truncated header)")
    if head[18] not in (1, 2) or head[19] not in (1, 2):  # SQLite would open it read-only, or not at all
        raise IndexCorrupt(f"{path} has a damaged header (file format versions {head[18]}/{head[19]})")
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        return  # after a crash mid-checkpoint the main file may be short; SQLite replays the WAL
    page_size = struct.unpack(">H", head[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    pages, change, valid_for = struct.unpack(">I", head[28:32])[0], head[24:28], head[92:96]
    if page_size < 512 or size % page_size or (change == valid_for and pages * page_size > size):
        raise IndexCorrupt(f"{path} is truncated ({size} bytes, header says {pages} pages of {page_size})")


JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")  # a rollback journal's first 8 bytes
COMPANIONS = ("-wal", "-shm", "-journal")           # SQLite's files next to the database


def hot_journal(path: Path) -> bool:
    """Is a rollback journal pending for a non-empty database (SQLite plays it back at open)?"""
    try:
        if os.lstat(path).st_size == 0:
            return False
        fd = fsafe.open_regular(path.with_name(path.name + "-journal"), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return os.pread(fd, 8, 0) == JOURNAL_MAGIC
    finally:
        os.close(fd)


def roll_back(path: Path) -> None:
    """Let SQLite play a hot journal back (the main file may be torn mid-transaction), so the
    checks that follow see the database as of its last commit."""
    try:
        conn = sqlite3.connect(fsafe.sqlite_uri(path), uri=True, isolation_level=None, timeout=30)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        error = IndexCorrupt if is_corruption(exc) else StoreIOError
        raise error(f"index {path}: rolling back its journal (a transaction a crash cut short) failed: "
                    f"{exc}; keep a copy of the folder") from exc
