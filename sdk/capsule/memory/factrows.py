"""A memory fact's columns: what a fact row holds in the store (a keyed-record Collection), the
limits add_fact enforces, the same checks on every row read back, and the older record forms.

A row that fails a check is a damaged fact: listings leave it out with a DamagedFactWarning,
single-fact reads raise FactRowCorrupt, `capsule verify` lists it. Format: docs/FORMAT.md, "Facts".
"""
from __future__ import annotations

import hashlib
import math
import struct
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..store import Collection
from .facterrors import DamagedFactWarning

# the column order is the record head's key order: the bytes stores already hold
FACTS = Collection("fact", (("text", "text"), ("tags", "texts"), ("n_tokens", "int"), ("fingerprint", "text"),
                            ("rope", "text"), ("created", "real")))
MAX_TEXT_BYTES = 64 << 10
MAX_TAGS, MAX_TAG_BYTES = 64, 256
MAX_LABEL_BYTES = 1024          # fingerprint, rope, embedder
MAX_EMBEDDING_BYTES = 1 << 20
MAX_N_TOKENS = (1 << 63) - 1
# a fact record written before format 3: magic, sha256 of the fact's text (UTF-8), then the KV
TEXT_BINDING = struct.Struct("<8s32s")
TEXT_BINDING_MAGIC = b"CPFTEXT\x01"
# the embedding cache blob: embedder name length, name (UTF-8), then the little-endian f32 vector
_CACHE_HEAD = struct.Struct("<H")


@dataclass(frozen=True)
class FactInfo:
    """One persistent memory fact (its KV payload is read with FactTable.fact_kv). fingerprint /
    rope name the model and position encoding the KV was computed under; created: unix time."""
    id: int
    text: str
    tags: tuple[str, ...]
    n_tokens: int
    fingerprint: str
    rope: str
    created: float


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


def check_kv_meta(n_tokens: Any, fingerprint: Any, rope: Any) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= MAX_N_TOKENS:
        raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r:.60}")
    check_label(fingerprint, "fingerprint")
    check_label(rope, "rope")


def _check_created(created: Any) -> None:
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ValueError(f"created must be a finite unix time, got {created!r:.60}")


_CHECKS = (("text", lambda r: check_text(r.get("text"))),
           ("tags", lambda r: check_tags(r.get("tags"))),
           ("n_tokens", lambda r: check_kv_meta(r.get("n_tokens"), "x", "x")),
           ("fingerprint", lambda r: check_label(r.get("fingerprint"), "fingerprint")),
           ("rope", lambda r: check_label(r.get("rope"), "rope")),
           ("created", lambda r: _check_created(r.get("created"))))
# set_fact_kv rewrites these, so it accepts a row where only they are damaged (the way out)
REWRITTEN_BY_SET_KV = frozenset({"n_tokens", "fingerprint", "rope"})


def damage(row: dict[str, Any], ignore: frozenset[str] = frozenset()) -> str | None:
    """Why a row breaks a fact's limits (the first field failing); None when it is sound."""
    for field, check in _CHECKS:
        if field not in ignore:
            try:
                check(row)
            except ValueError as exc:
                return f"{field}: {exc}"
    return None


def info(fact_id: int, row: dict[str, Any]) -> FactInfo:
    """The FactInfo of a sound row."""
    return FactInfo(fact_id, row["text"], tuple(row["tags"]), row["n_tokens"], row["fingerprint"], row["rope"],
                    float(row["created"]))


def row_of(text: str, tags: list[str], n_tokens: int, fingerprint: str, rope: str, created: float) -> dict[str, Any]:
    return {"text": text, "tags": tags, "n_tokens": n_tokens, "fingerprint": fingerprint, "rope": rope,
            "created": created}


def warn_damaged(fact_id: Any, why: str) -> None:
    warnings.warn(DamagedFactWarning(
        f"memory fact {fact_id} is damaged and was skipped: {why}. Other facts are unaffected; forget it "
        f"(Session.forget({fact_id})) and remember it again; `capsule verify` lists all damage"), stacklevel=4)


def unbind(blob: bytes, text: str, headless: bool) -> bytes:
    """The KV bytes of a fact's record blob. A headless record (written before format 3) is either
    the text binding (checked against text: ValueError when it names another) or bare KV bytes."""
    if headless and len(blob) >= TEXT_BINDING.size and blob[:8] == TEXT_BINDING_MAGIC:
        if TEXT_BINDING.unpack_from(blob)[1] != hashlib.sha256(text.encode("utf-8")).digest():
            raise ValueError("text differs from the text its KV record was encoded from (it was edited in "
                             "index.sqlite after the fact was stored) (sha256 mismatch)")
        return blob[TEXT_BINDING.size:]
    return blob


def encode_embedding(embedder: str, embedding: Any) -> bytes:
    check_label(embedder, "embedder")
    try:
        vec = bytes(memoryview(embedding).cast("B"))
    except (TypeError, ValueError):
        raise ValueError(f"embedding must be bytes or a C-contiguous buffer, got {type(embedding).__name__}") \
            from None
    if not vec or len(vec) > MAX_EMBEDDING_BYTES:
        raise ValueError(f"embedding is {len(vec)} bytes; it must hold 1 to {MAX_EMBEDDING_BYTES} (1 MiB)")
    name = embedder.encode("utf-8")
    return _CACHE_HEAD.pack(len(name)) + name + vec


def decode_embedding(blob: bytes) -> tuple[str, bytes] | None:
    """(embedder, embedding) of a cache blob; None when it is not one (a cache is recomputed)."""
    if len(blob) < _CACHE_HEAD.size:
        return None
    (n,) = _CACHE_HEAD.unpack_from(blob)
    name, vec = blob[_CACHE_HEAD.size:_CACHE_HEAD.size + n], blob[_CACHE_HEAD.size + n:]
    try:
        text = name.decode("utf-8")
        check_label(text, "embedder")
    except ValueError:
        return None
    return (text, vec) if 0 < len(vec) <= MAX_EMBEDDING_BYTES else None
