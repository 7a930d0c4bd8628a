"""index.sqlite's tables (see docs/FORMAT.md, "Index"), created through sqlite-utils.

sqlite-utils is imported only when a store is created: it pulls in click, pluggy and dateutil
(~50 ms), which an open of an existing store — a restore after a power cut — never needs.
"""
from __future__ import annotations

import sqlite3

from . import keyeddb

SCHEMA_VERSION = 1   # meta 'schema_version' of index.sqlite


def create(conn: sqlite3.Connection) -> None:
    """Inside a transaction: every table and index of a new store."""
    import sqlite_utils
    db = sqlite_utils.Database(conn, recursive_triggers=False, execute_plugins=False)
    db["meta"].create({"key": str, "value": str}, pk="key", not_null={"value"}, if_not_exists=True)
    db["segments"].create({"id": int, "committed_end": int, "state": str}, pk="id",
                          not_null={"committed_end", "state"}, if_not_exists=True)
    db["epochs"].create({"id": int, "name": str, "created": float, "bytes_written": int,
                         "n_pages": int, "meta": str, "base": int, "man_segment": int,
                         "man_offset": int, "man_length": int}, pk="id",
                        not_null={"created", "bytes_written", "n_pages", "meta", "base",
                                  "man_segment", "man_offset", "man_length"}, if_not_exists=True)
    db["epochs"].create_index(["name"], unique=True, if_not_exists=True)
    db["epochs"].create_index(["man_segment", "man_offset"], if_not_exists=True)
    db["pages"].create({"region": str, "idx": int, "epoch": int, "rec_epoch": int, "segment": int,
                        "offset": int, "length": int, "superseded": int}, pk=("region", "idx", "epoch"),
                       not_null={"region", "idx", "epoch", "rec_epoch"}, if_not_exists=True)
    db["pages"].create_index(["epoch"], if_not_exists=True)
    db["pages"].create_index(["superseded"], if_not_exists=True)
    db["pages"].create_index(["segment", "offset"], if_not_exists=True)
    keyeddb.create_schema(conn)
