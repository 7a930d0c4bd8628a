"""A fact's fields: the limits add_fact enforces, the same checks on every `facts` row read back
(index.sqlite is untrusted input like the segments). The KV record's own format: factrecord.py.

A row that fails a check is a damaged fact: listings leave it out with a DamagedFactWarning,
single-fact reads raise FactRowCorrupt, `verify` lists it. Only structural damage (the table or
the database itself) stays an IndexCorrupt. Format: docs/FORMAT.md, "Facts".
"""
from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

from .errors import DamagedFactWarning
from .info import FactInfo
from .records import MAX_EPOCH, MAX_PAGE_INDEX

MAX_TEXT_BYTES = 64 << 10
MAX_TAGS, MAX_TAG_BYTES = 64, 256
MAX_LABEL_BYTES = 1024          # fingerprint, rope, embedder
MAX_EMBEDDING_BYTES = 1 << 20
_MAX_TAGS_JSON = 1 << 20        # longer is damage without parsing it

# text columns are read as (type, bytes) and decoded here: sqlite3 raises on invalid UTF-8 for
# the whole query, and one damaged row must not break every read
_TEXT_COLUMNS = ("text", "tags", "fingerprint", "rope", "embedder")
_COLUMNS = ("id", "text", "tags", "n_tokens", "fingerprint", "rope", "created", "embedder")
# what from_sql reads (embedding: its SQLite type and length, not the blob)
ROW_COLUMNS = ", ".join([f'typeof("{c}"), CAST("{c}" AS BLOB)' if c in _TEXT_COLUMNS else f'"{c}"'
                         for c in _COLUMNS] + ["typeof(embedding), length(embedding), kv_version, "
                                               "kv_segment, kv_offset, kv_length"])
_ROW_WIDTH = len(_COLUMNS) + len(_TEXT_COLUMNS) + 6


class Undecodable(NamedTuple):
    """A text column holding something other than valid UTF-8 text (checks reject it)."""
    sql_type: str
    raw: bytes | None

    def __repr__(self) -> str:
        what = "text that is not UTF-8" if self.sql_type == "text" else f"{self.sql_type} value"
        return f"<SQLite {what}: {self.raw!r:.40}>"


class FactRow(NamedTuple):
    """One `facts` row as read: every field unchecked (see damage)."""
    id: Any
    text: Any
    tags: Any
    n_tokens: Any
    fingerprint: Any
    rope: Any
    created: Any
    embedder: Any
    emb_type: Any
    emb_len: Any
    kv_version: Any
    kv_segment: Any
    kv_offset: Any
    kv_length: Any


def from_sql(raw: tuple) -> FactRow:
    """The FactRow of one result row of SELECT ROW_COLUMNS (extra trailing columns are ignored)."""
    values, it = [], iter(raw[:_ROW_WIDTH])
    for column in _COLUMNS:
        if column not in _TEXT_COLUMNS:
            values.append(next(it))
            continue
        sql_type, blob = next(it), next(it)
        if sql_type == "null":
            values.append(None)
            continue
        try:
            if sql_type != "text":
                raise ValueError
            values.append(bytes(blob).decode("utf-8"))
        except ValueError:
            values.append(Undecodable(sql_type, None if blob is None else bytes(blob)))
    return FactRow(*values, *it)


# -- the checks add_fact / set_fact_kv make (ValueError) ----------------------------------------
def utf8_len(value: str, what: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogates)") from None


def check_text(text: Any) -> None:
    if not isinstance(text, str) or not text:
        raise ValueError(f"fact text must be a non-empty str, got {text!r:.60}")
    if utf8_len(text, "fact text") > MAX_TEXT_BYTES:
        raise ValueError(f"fact text is {utf8_len(text, 'fact text')} UTF-8 bytes; the limit is "
                         f"{MAX_TEXT_BYTES} (64 KiB): split it into several facts")


def check_tags(tags: Any) -> list[str]:
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise ValueError(f"tags must be a sequence of str (e.g. a tuple), got {type(tags).__name__}")
    out = list(tags)
    if len(out) > MAX_TAGS:
        raise ValueError(f"a fact has at most {MAX_TAGS} tags, got {len(out)}")
    for tag in out:
        if not isinstance(tag, str) or not tag or utf8_len(tag, "a tag") > MAX_TAG_BYTES:
            raise ValueError(f"each tag must be a non-empty str of at most {MAX_TAG_BYTES} UTF-8 bytes, "
                             f"got {tag!r:.60}")
    return out


def check_label(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value or utf8_len(value, what) > MAX_LABEL_BYTES:
        raise ValueError(f"{what} must be a non-empty str of at most {MAX_LABEL_BYTES} UTF-8 bytes, "
                         f"got {value!r:.60}")


def check_n_tokens(n_tokens: Any) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= MAX_PAGE_INDEX:
        raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r:.60}")


def check_kv_meta(n_tokens: Any, fingerprint: Any, rope: Any) -> None:
    check_n_tokens(n_tokens)
    check_label(fingerprint, "fingerprint")
    check_label(rope, "rope")


def check_embedding(embedding: Any, embedder: Any) -> bytes | None:
    if embedding is None and embedder is None:
        return None
    if embedding is None or embedder is None:
        raise ValueError("give embedding and embedder together (or neither)")
    check_label(embedder, "embedder")
    try:
        blob = bytes(memoryview(embedding).cast("B"))
    except (TypeError, ValueError):
        raise ValueError(f"embedding must be bytes or a C-contiguous buffer, got {type(embedding).__name__}") \
            from None
    if not blob or len(blob) > MAX_EMBEDDING_BYTES:
        raise ValueError(f"embedding is {len(blob)} bytes; it must hold 1 to {MAX_EMBEDDING_BYTES} (1 MiB)")
    return blob


# -- rows read back ---------------------------------------------------------------------------
def parse_tags(raw: Any) -> list[str]:
    """A row's tags column: a JSON list of strings within the add_fact limits (ValueError if not)."""
    if not isinstance(raw, str) or len(raw) > _MAX_TAGS_JSON:
        raise ValueError(f"not a JSON list of strings: {raw!r:.80}")
    return list(_parsed_tags(raw))


@functools.lru_cache(maxsize=4096)
def _parsed_tags(raw: str) -> tuple[str, ...]:
    # rows share few distinct tag lists ('[]' most of all): a listing parses each once
    try:
        tags = json.loads(raw)
    except (ValueError, RecursionError):
        tags = None
    if not isinstance(tags, list):
        raise ValueError(f"not a JSON list of strings: {raw!r:.80}")
    return tuple(check_tags(tags))


def lenient_tags(raw: Any) -> list[str]:
    """For filling facts_fts: a damaged tags column counts as no tags (the row is skipped on read)."""
    try:
        return parse_tags(raw)
    except ValueError:
        return []


def _is_int(value: Any, lo: int, hi: int = MAX_PAGE_INDEX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _check_created(created: Any) -> None:
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ValueError(f"created must be a finite unix time, got {created!r:.60}")


def _check_stored_embedding(row: FactRow) -> None:
    if row.embedder is None and row.emb_type == "null":
        return
    if row.embedder is None or row.emb_type != "blob":
        raise ValueError(f"embedder and embedding must be both set (a blob) or both NULL, got embedder "
                         f"{row.embedder!r:.60} and an embedding of SQLite type {row.emb_type}")
    check_label(row.embedder, "embedder")
    if not _is_int(row.emb_len, 1, MAX_EMBEDDING_BYTES):
        raise ValueError(f"embedding is {row.emb_len} bytes; it must hold 1 to {MAX_EMBEDDING_BYTES}")


def _check_kv_location(row: FactRow) -> None:
    for name in ("kv_segment", "kv_offset", "kv_length"):
        if not _is_int(getattr(row, name), 0):
            raise ValueError(f"{name} must be an int >= 0, got {getattr(row, name)!r:.60}")


def _check_kv_version(version: Any) -> None:
    if not _is_int(version, 1, MAX_EPOCH):
        raise ValueError(f"kv_version must be an int >= 1, got {version!r:.60}")


def _check_id(row: FactRow) -> None:
    if not _is_int(row.id, 1):
        raise ValueError(f"id must be an int >= 1, got {row.id!r:.60}")


_CHECKS = (("id", _check_id),
           ("text", lambda r: check_text(r.text)),
           ("tags", lambda r: parse_tags(r.tags)),
           ("n_tokens", lambda r: check_n_tokens(r.n_tokens)),
           ("fingerprint", lambda r: check_label(r.fingerprint, "fingerprint")),
           ("rope", lambda r: check_label(r.rope, "rope")),
           ("created", lambda r: _check_created(r.created)),
           ("embedding", _check_stored_embedding),
           ("kv_version", lambda r: _check_kv_version(r.kv_version)),
           ("kv location", _check_kv_location))
# set_fact_kv rewrites these, so it accepts a row where only they are damaged (the way out)
REWRITTEN_BY_SET_KV = frozenset({"n_tokens", "fingerprint", "rope", "kv location"})


def damage(row: FactRow, ignore: frozenset[str] = frozenset()) -> str | None:
    """Why the row is damaged (the first field that fails its check), or None when it is sound."""
    for field, check in _CHECKS:
        if field not in ignore:
            try:
                check(row)
            except ValueError as exc:
                return f"{field}: {exc}"
    return None


def info(row: FactRow) -> FactInfo:
    """The FactInfo of a row that passed damage()."""
    return FactInfo(row.id, row.text, tuple(parse_tags(row.tags)), row.n_tokens, row.fingerprint,
                    row.rope, float(row.created), row.embedder)


def sound(rows: Iterable[tuple]) -> list[FactRow]:
    """The rows that pass damage(); each other one is left out with a DamagedFactWarning."""
    out = []
    for raw in rows:
        row = from_sql(raw)
        why = damage(row)
        if why is None:
            out.append(row)
        else:
            warn_damaged(row.id, f"its index row is damaged ({why})")
    return out


def warn_damaged(fact_id: Any, why: str) -> None:
    warnings.warn(DamagedFactWarning(
        f"memory fact {fact_id} is damaged and was skipped: {why}. Other facts are unaffected; forget it "
        f"(Session.forget({fact_id})) and remember it again; `capsule verify` lists all damage"), stacklevel=5)
