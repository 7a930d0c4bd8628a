"""Fleet memory objects as bytes: a fact, its K/V under one model, and a forget (a tombstone).

Each is a sealed object (sealed.py: magic | head JSON | blob | tag, one tag domain per kind). A fact is named by its
content hash h = SHA-256 of the JSON [text, sorted tags]; every object's head repeats h, and a
fact object whose text and tags do not hash to its name is refused, so no object can stand in for
another fact's. Pure functions over untrusted bytes, bounded before use (RemoteCorrupt).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..memory import factrows
from .errors import RemoteCorrupt
from .sealed import open_object, seal_object
from .wire import Seal

MAGIC_FACT, MAGIC_KV, MAGIC_FORGET = b"CPFLFACT", b"CPFLKV\x00\x00", b"CPFLFORG"
_DOMAINS = {MAGIC_FACT: b"capsule.fleet fact\x00", MAGIC_KV: b"capsule.fleet kv\x00",
            MAGIC_FORGET: b"capsule.fleet forget\x00"}
MAX_EMBEDDING_BYTES = 1 << 20
MAX_KV_BYTES = 256 << 20


def content_hash(text: str, tags: tuple[str, ...] | list[str]) -> str:
    """A fact's fleet name: equal text and tags (in any order) are one fact."""
    return hashlib.sha256(json.dumps([text, sorted(tags)], ensure_ascii=False).encode()).hexdigest()


def model_key(fingerprint: str, rope: str) -> str:
    """Which model a K/V object is for (its key under kv/<h>/)."""
    return hashlib.sha256(f"{fingerprint}\n{rope}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class FleetFact:
    hash: str
    text: str
    tags: tuple[str, ...]
    created: float
    embedder: str | None          # the embedding's model name (None: none published)
    embedding: bytes = b""        # little-endian f32


@dataclass(frozen=True)
class FleetKV:
    hash: str
    fingerprint: str
    rope: str
    n_tokens: int
    kv: bytes


def _seal(magic: bytes, head: dict, blob: bytes, seal: Seal) -> bytes:
    return seal_object(magic, _DOMAINS[magic], head, blob, seal)


def _open(data: bytes, magic: bytes, seal: Seal, where: str, max_blob: int) -> tuple[dict, bytes]:
    return open_object(data, magic, _DOMAINS[magic], seal, where, max_blob)


def encode_fact(f: FleetFact, seal: Seal) -> bytes:
    return _seal(MAGIC_FACT, {"fact": f.hash, "text": f.text, "tags": list(f.tags), "created": f.created,
                              "embedder": f.embedder}, f.embedding, seal)


def decode_fact(data: bytes, seal: Seal, where: str, name: str) -> FleetFact:
    head, blob = _open(data, MAGIC_FACT, seal, where, MAX_EMBEDDING_BYTES)
    try:
        text, tags, created, embedder = head["text"], head["tags"], head["created"], head["embedder"]
        factrows.check_text(text)
        tags = tuple(factrows.check_tags(tags))
        if not isinstance(created, (int, float)) or not (embedder is None or isinstance(embedder, str)):
            raise ValueError("created / embedder have the wrong types")
        if len(blob) % 4 or (embedder is None and blob):
            raise ValueError("the embedding is not f32 values of a named embedder")
    except (KeyError, ValueError) as exc:
        raise RemoteCorrupt(where, str(exc)) from None
    h = content_hash(text, tags)
    if h != name or head.get("fact") != name:
        raise RemoteCorrupt(where, "its text and tags are not the fact its name says")
    return FleetFact(h, text, tags, float(created), embedder, blob)


def encode_kv(k: FleetKV, seal: Seal) -> bytes:
    return _seal(MAGIC_KV, {"fact": k.hash, "fingerprint": k.fingerprint, "rope": k.rope, "n_tokens": k.n_tokens},
                 k.kv, seal)


def decode_kv(data: bytes, seal: Seal, where: str, name: str, fingerprint: str, rope: str) -> FleetKV:
    head, blob = _open(data, MAGIC_KV, seal, where, MAX_KV_BYTES)
    n = head.get("n_tokens")
    if (head.get("fact"), head.get("fingerprint"), head.get("rope")) != (name, fingerprint, rope) \
            or not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RemoteCorrupt(where, "it is not this fact's K/V under this model")
    return FleetKV(name, fingerprint, rope, n, blob)


def encode_forget(h: str, when: float, by: str, seal: Seal) -> bytes:
    return _seal(MAGIC_FORGET, {"fact": h, "forgotten": when, "by": by}, b"", seal)


def decode_forget(data: bytes, seal: Seal, where: str, name: str) -> dict[str, Any]:
    head, _ = _open(data, MAGIC_FORGET, seal, where, 0)
    if head.get("fact") != name:
        raise RemoteCorrupt(where, "it forgets another fact than its name says")
    return head
