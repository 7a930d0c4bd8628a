"""Typed reads of index.sqlite rows: the index is untrusted input like the segments.

SQLite keeps whatever type a value was written with (a TEXT in an INTEGER column, a REAL, a BLOB),
so every value the store uses is checked here: type, range, size, and for JSON texts the bounds
of capsule.safejson. A failing value raises RowError, which the index turns into IndexCorrupt
(and the store into a rebuild from the log). Keyed-record rows have their own, per-record checks
(keyedrows.py): one damaged record must not break the others.
"""
from __future__ import annotations

import math
from typing import Any

from .. import safejson
from .info import EpochInfo, Head, PageRef
from .records import MAX_EPOCH, MAX_NAME_BYTES, MAX_RECORD_BYTES, TAG_BYTES

MAX_META_BYTES = 1 << 20    # an epoch's meta (the caller's small JSON object) is far smaller
_MAX_INT = (1 << 63) - 1


class RowError(ValueError):
    """An index value of the wrong type or out of range; str() names the column."""


def int_(value: Any, column: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RowError(f"{column} holds {_show(value)}, not an integer in {lo}..{hi}")
    return value


def opt_int(value: Any, column: str, lo: int = 0) -> int | None:
    return None if value is None else int_(value, column, lo)


def str_(value: Any, column: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    if not isinstance(value, str) or len(value) > max_bytes:
        raise RowError(f"{column} holds {_show(value)}, not a text of at most {max_bytes} characters")
    return value


def real(value: Any, column: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError(f"{column} holds {_show(value)}, not a finite number")
    return float(value)


def ref(region: Any, index: Any, epoch: int, segment: Any, offset: Any, length: Any) -> PageRef:
    """A row's record location (None throughout: a tombstone), every field checked."""
    if region is not None:
        region, index = str_(region, "pages.region"), int_(index, "pages.idx")
    if segment is None and offset is None and length is None:
        return PageRef(region, index, int_(epoch, "pages.rec_epoch", 1, MAX_EPOCH), None, None, None)
    return PageRef(region, index, int_(epoch, "pages.rec_epoch", 1, MAX_EPOCH), int_(segment, "segment", 1),
                   int_(offset, "offset"), int_(length, "length", 1, MAX_RECORD_BYTES))


def epoch_info(row: tuple) -> EpochInfo:
    i, name, created, written, n_pages, meta, base = row
    if name is not None:
        str_(name, "epochs.name", 256)
    text = str_(meta, "epochs.meta", MAX_META_BYTES)
    try:
        doc = safejson.loads(text, what="epochs.meta", max_bytes=MAX_META_BYTES, max_depth=8)
    except ValueError as exc:
        raise RowError(str(exc)) from None
    if not isinstance(doc, dict):
        raise RowError(f"epochs.meta of epoch {i} is {type(doc).__name__}, not an object")
    return EpochInfo(int_(i, "epochs.id", 1), name, real(created, "epochs.created"), int_(written, "bytes_written"),
                     int_(n_pages, "epochs.n_pages"), doc, int_(base, "epochs.base"))


def meta(found: list[tuple]) -> dict[str, str]:
    out = {}
    for key, value in found:
        out[str_(key, "meta.key", 64)] = str_(value, f"meta.{key}", 4096)
    return out


def head_text(head: Head) -> str:
    return f"{head.segment}:{head.offset}:{head.length}:{head.tag.hex()}"


def head(text: Any) -> Head:
    parts = str_(text, "meta.head", 200).split(":")
    try:
        seg, off, length, tag = int(parts[0]), int(parts[1]), int(parts[2]), bytes.fromhex(parts[3])
    except (ValueError, IndexError):
        raise RowError(f"meta.head holds {_show(text)}, not segment:offset:length:tag") from None
    if len(parts) != 4 or len(tag) not in TAG_BYTES.values() or seg < 1 or off < 0 or length < 1:
        raise RowError(f"meta.head holds {_show(text)}, not segment:offset:length:tag")
    return Head(seg, off, length, tag)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.40}"
