"""Crash states of the very first Store.open: what a kill inside it can leave (the folder, LOCK,
an empty or schema-less index, an empty first segment), written by SQLite and mkdir rather than
through FileOps, so they are built here explicitly and checked with the kill oracle.
"""
from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from ...store import Store
from . import reliability_oracle as O
from . import reliability_tally as T
from .reliability_ledger import Ledger


def creation_states(work: Path, key: bytes | None) -> T.Tally:
    """States a kill inside the very first Store.open can leave (written by SQLite and mkdir)."""
    tally = T.Tally()
    probe = work / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    Store.open(probe, sign_key=key).close()
    schema = (probe / "index.sqlite").read_bytes()
    states = {"empty folder": {}, "LOCK only": {"LOCK": b""}, "LOCK + segments/": {"LOCK": b"", "segments/": None},
              "empty index.sqlite": {"LOCK": b"", "index.sqlite": b"", "segments/": None},
              "index.sqlite, empty WAL database": {"index.sqlite": _wal_db(work)},
              "index.sqlite without meta rows": {"index.sqlite": _without_meta(work, schema)},
              "index + an empty first segment file": {"index.sqlite": schema, "segments/000001.seg": b""}}
    for name, files in states.items():
        folder = work / f"create-{abs(hash(name))}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for rel, data in files.items():
            if data is None:
                (folder / rel).mkdir(exist_ok=True)
            else:
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_bytes(data)
        problems = O.check_store(folder, Ledger(), sign_key=key)
        tally.add("crash states")
        tally.add("crash states recovered" if not problems else "crash states failed")
        for p in problems:
            tally.fail(f"crash state (first open): {T.cause_of(p)}",
                       T.describe(family="crash state", at="first open", state=name, signed=key is not None,
                                  kept=str(folder)) + f" :: {p}")
    return tally


def _wal_db(work: Path) -> bytes:
    p = work / "wal.sqlite"
    p.unlink(missing_ok=True)
    conn = sqlite3.connect(p)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    return p.read_bytes()


def _without_meta(work: Path, schema: bytes) -> bytes:
    p = work / "nometa.sqlite"
    p.write_bytes(schema)
    conn = sqlite3.connect(p)
    try:
        conn.execute("DELETE FROM meta")
        conn.commit()
    except sqlite3.Error:
        pass
    conn.close()
    return p.read_bytes()
