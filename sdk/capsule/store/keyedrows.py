"""Keyed records' rows: the columns a caller declares (Collection), the checks every row passes
when it is written, and the same checks on every row read back (index.sqlite is untrusted input).

A row is a small JSON object of typed columns. A row read back that fails a check is a *damaged
record*: listings hand it out flagged (StoredRow.damage; the caller says so), reads by id raise
RecordRowCorrupt, `verify` lists it. Only structural damage (the table, the database) is an IndexCorrupt.
Format: docs/FORMAT.md, "Keyed records".
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from .. import safejson
from .records import MAX_EPOCH, MAX_PAGE_INDEX

MAX_ROW_BYTES = (1 << 20) - 1024   # a row as JSON: leaves room for the store id in the record head
MAX_CACHE_BYTES = 2 << 20         # a cache blob (index only)
MAX_COLUMNS = 64
TYPES = ("text", "int", "real", "texts")   # str, int (64-bit), finite float, list of str
_MAX_INT = (1 << 63) - 1


@dataclass(frozen=True)
class Collection:
    """A kind of keyed record: `name` (the records' region in the log; ids are per collection) and
    the row's columns as (name, type) pairs, type one of TYPES. Rows must hold exactly them."""
    name: str
    columns: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or len(self.name) > 64:
            raise ValueError(f"a collection name is an identifier of at most 64 characters, got {self.name!r:.80}")
        names = [c[0] for c in self.columns]
        if not 0 < len(names) <= MAX_COLUMNS or len(set(names)) != len(names) or "store" in names:
            raise ValueError(f"collection {self.name!r}: declare 1..{MAX_COLUMNS} distinct columns (not 'store'), "
                             f"got {names!r:.200}")
        for name, kind in self.columns:
            if not isinstance(name, str) or not name.isidentifier() or kind not in TYPES:
                raise ValueError(f"collection {self.name!r}: column {name!r} of type {kind!r}: a column is an "
                                 f"identifier with a type among {TYPES}")


class StoredRow(NamedTuple):
    """One index row as read: id and version checked; `row` the caller's columns when they pass
    (else None, and `damage` says why); `raw` the JSON object as parsed, types unchecked (None
    when the row is not one), for a caller that can repair a row from its sound columns."""
    id: int
    version: int
    row: dict[str, Any] | None
    damage: str | None
    raw: dict[str, Any] | None = None


def record_id(value: Any) -> int | None:
    """The id as an int (None: out of range, so no record has it); ValueError for a non-integer.
    Integer types such as numpy.int64 are accepted."""
    try:
        if isinstance(value, bool):
            raise TypeError
        rid = operator.index(value)
    except TypeError:
        raise ValueError(f"a record id is an int, got {type(value).__name__} {value!r:.60}") from None
    return rid if 0 < rid <= MAX_PAGE_INDEX else None


def check_row(coll: Collection, row: Any) -> dict[str, Any]:
    """The row as a plain dict in column order, every column of its type (ValueError naming the
    column otherwise)."""
    if not isinstance(row, Mapping):
        raise ValueError(f"a {coll.name} row is a mapping of its columns, got {type(row).__name__}")
    want = [c for c, _ in coll.columns]
    if set(row) != set(want):
        missing, extra = sorted(set(want) - set(row)), sorted(set(row) - set(want), key=str)
        raise ValueError(f"a {coll.name} row holds exactly the columns {want}; missing {missing}, extra {extra!r:.120}")
    out = {}
    for name, kind in coll.columns:
        out[name] = _typed(row[name], kind, f"{coll.name}.{name}")
    size = len(safejson.dumps(out))
    if size > MAX_ROW_BYTES:
        raise ValueError(f"a {coll.name} row is {size} bytes as JSON; the limit is {MAX_ROW_BYTES}")
    return out


def _typed(value: Any, kind: str, what: str) -> Any:
    if kind == "text" and isinstance(value, str):
        _utf8(value, what)
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool) and -_MAX_INT - 1 <= value <= _MAX_INT:
        return value
    if kind == "real" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if kind == "texts" and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        for v in value:
            _utf8(v, what)
        return list(value)
    raise ValueError(f"{what} must be of type {kind}, got {type(value).__name__} {value!r:.60}")


def _utf8(value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogates)") from None


def check_cache(blob: Any) -> bytes | None:
    if blob is None:
        return None
    try:
        out = bytes(memoryview(blob).cast("B"))
    except (TypeError, ValueError):
        raise ValueError(f"a cache blob is bytes or a C-contiguous buffer, got {type(blob).__name__}") from None
    if not 0 < len(out) <= MAX_CACHE_BYTES:
        raise ValueError(f"a cache blob holds 1 to {MAX_CACHE_BYTES} bytes, got {len(out)}")
    return out


# -- rows read back ---------------------------------------------------------------------------
def is_int(value: Any, lo: int, hi: int = MAX_PAGE_INDEX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def read_row(coll: Collection, rid: Any, version: Any, row_type: Any, row_raw: Any) -> StoredRow:
    """Check one row of SELECT id, version, typeof(row), CAST(row AS BLOB): never raises."""
    if not is_int(rid, 1) or not is_int(version, 1, MAX_EPOCH):
        what = "id" if not is_int(rid, 1) else "version"
        return StoredRow(rid, version, None, f"{what}: {(rid, version)[what == 'version']!r:.40} is not an int >= 1")
    why = any_row_damage(row_type, row_raw)
    if why:
        return StoredRow(rid, version, None, f"row: {why}")
    raw = safejson.loads(row_raw, what="row", max_bytes=MAX_ROW_BYTES, max_depth=4)
    try:
        return StoredRow(rid, version, check_row(coll, raw), None, raw)
    except ValueError as exc:
        return StoredRow(rid, version, None, f"row: {exc}", raw)


def any_row_damage(row_type: Any, row_raw: Any) -> str | None:
    """Why a row is not a bounded JSON object whatever its columns (None: it is one)."""
    if row_type != "text" or not isinstance(row_raw, bytes) or len(row_raw) > MAX_ROW_BYTES:
        return f"not a JSON text of at most {MAX_ROW_BYTES} bytes (SQLite type {row_type})"
    try:
        doc = safejson.loads(row_raw, what="row", max_bytes=MAX_ROW_BYTES, max_depth=4)
    except ValueError as exc:
        return str(exc)
    return None if isinstance(doc, dict) else f"a JSON {type(doc).__name__}, not an object"


def location_damage(segment: Any, offset: Any, length: Any) -> str | None:
    for name, value, lo in (("segment", segment, 1), ("offset", offset, 0), ("length", length, 1)):
        if not is_int(value, lo):
            return f"{name}: {value!r:.40} is not an int >= {lo}"
    return None
