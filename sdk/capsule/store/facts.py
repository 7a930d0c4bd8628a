"""Persistent memory facts on the Store: one index row (+ its full-text row) and one KV record each.

A KV write (add_fact, set_fact_kv) follows the epoch commit protocol through
Committer.commit_record: staged epochs commit first, then append the KIND_FACT record -> fsync
-> ONE index transaction. forget_fact and set_fact_embedding touch only the index (one
transaction each). Writers hold the writer lock; readers only the state lock. A fact record is
bound to its fact id and KV version (record index / epoch fields), so no other record can stand
in for it. Format and invariants: docs/FORMAT.md, "Facts".
"""
from __future__ import annotations

import operator
import threading
import time
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from . import factdb
from .errors import FactCorrupt, UnknownFact
from .info import FactInfo
from .inputs import as_bytes_view
from .reader import check_record, check_ref
from .records import FACT_REGION, KIND_FACT, MAX_EPOCH, MAX_PAGE_INDEX, RecordError, Sealer
from .segments import SegmentReader

if TYPE_CHECKING:
    from .commit import Committer
    from .index import Index

MAX_TEXT_BYTES = 64 << 10
MAX_TAGS, MAX_TAG_BYTES = 64, 256
MAX_LABEL_BYTES = 1024          # fingerprint, rope, embedder
MAX_EMBEDDING_BYTES = 1 << 20


class FactsMixin:
    """The fact API of Store (mixed in: it uses the Store's locks, index and committer)."""

    path: Path
    _index: Index
    _sealer: Sealer
    _seg_dir: Path
    _commit: Committer
    _wlock: threading.RLock
    _lock: threading.RLock

    def _check_open(self) -> None:  # provided by Store
        raise NotImplementedError

    # -- write --------------------------------------------------------------------------------
    def add_fact(self, text: str, *, tags: Sequence[str] = (), n_tokens: int, fingerprint: str, rope: str,
                 kv: Any, embedding: bytes | None = None, embedder: str | None = None) -> int:
        """Store a fact (its text, tags, and the KV computed for it under model `fingerprint` with
        position encoding `rope`); returns its new id (ids only grow, never reused). Durable when
        it returns. Staged epochs, if any, are committed first."""
        _check_text(text)
        tag_list = _check_tags(tags)
        _check_kv_meta(n_tokens, fingerprint, rope)
        data = as_bytes_view(kv, "kv")
        emb = _check_embedding(embedding, embedder)
        with self._wlock:
            self._check_open()
            with self._lock:
                fact_id = factdb.next_id(self._index)
            created = time.time()
            self._commit.commit_record(
                KIND_FACT, 1, FACT_REGION, fact_id, data, f"writing fact {fact_id}",
                lambda c, ref: factdb.insert(c, fact_id, text, tag_list, n_tokens, fingerprint, rope, created,
                                             ref, emb, embedder))
            return fact_id

    def set_fact_kv(self, fact_id: int, *, n_tokens: int, fingerprint: str, rope: str, kv: Any) -> None:
        """Replace a fact's KV (re-encoded under another model); the old record becomes dead
        bytes for compaction. Durable when it returns."""
        fid = self._known_id(fact_id)
        _check_kv_meta(n_tokens, fingerprint, rope)
        data = as_bytes_view(kv, "kv")
        with self._wlock:
            self._check_open()
            with self._lock:
                old = factdb.kv_ref(self._index, fid)
            if old is None:
                raise self._unknown(fid)
            if old.rec_epoch >= MAX_EPOCH:
                raise ValueError(f"fact {fid} was re-encoded {old.rec_epoch} times; add it as a new fact")
            self._commit.commit_record(
                KIND_FACT, old.rec_epoch + 1, FACT_REGION, fid, data, f"re-encoding fact {fid}",
                lambda c, ref: factdb.set_kv(c, fid, n_tokens, fingerprint, rope, ref))

    def set_fact_embedding(self, fact_id: int, embedding: bytes | None, embedder: str | None) -> None:
        """Set (or, with None, None: clear) a fact's retrieval embedding, an opaque blob."""
        fid = self._known_id(fact_id)
        emb = _check_embedding(embedding, embedder)
        self._index_only(fid, f"setting the embedding of fact {fid}",
                         lambda c: factdb.set_embedding(c, fid, emb, embedder))

    def forget_fact(self, fact_id: int) -> None:
        """Delete a fact (UnknownFact if there is none); compaction reclaims its record."""
        fid = self._known_id(fact_id)
        self._index_only(fid, f"forgetting fact {fid}", lambda c: factdb.delete(c, fid))

    def _index_only(self, fid: int, what: str, apply: Any) -> None:
        with self._wlock, self._lock:
            self._check_open()
            if factdb.kv_ref(self._index, fid) is None:
                raise self._unknown(fid)
            self._index.write(what, apply)

    # -- read ---------------------------------------------------------------------------------
    def facts(self, ids: Iterable[int] | None = None) -> list[FactInfo]:
        """Every fact, or those of `ids` that exist (unknown ids are left out), ordered by id."""
        wanted = None if ids is None else [i for i in map(_fact_id, ids) if i is not None]
        with self._lock:
            self._check_open()
            return factdb.infos(self._index, wanted)

    def fact_kv(self, fact_id: int) -> bytes:
        """A fact's KV bytes, after verifying its record (tag, and kind / fact id / KV version /
        length equal the index row). Damage raises FactCorrupt (a PageCorrupt, region "fact")."""
        fid = self._known_id(fact_id)
        with self._lock:
            self._check_open()
            ref = factdb.kv_ref(self._index, fid)
            if ref is None:
                raise self._unknown(fid)
            with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
                try:
                    check_ref(ref)
                    view = segs.view(ref.segment, ref.offset, ref.length)  # type: ignore[arg-type]
                    return bytes(check_record(view, ref, self._sealer))    # the one copy out of the map
                except RecordError as exc:
                    raise FactCorrupt(fid, ref.rec_epoch, ref.segment, ref.offset, str(exc)) from None

    def fact_embeddings(self) -> list[tuple[int, str, bytes]]:
        """(id, embedder, embedding) of every fact that has an embedding, ordered by id."""
        with self._lock:
            self._check_open()
            return factdb.embeddings(self._index)

    def search_facts(self, query: str, k: int) -> list[tuple[int, float]]:
        """Up to k (fact id, score) by lexical relevance of text and tags, best first (higher is
        better). With SQLite FTS5: BM25 (negated) over an OR of the query's words, Porter-stemmed.
        Without FTS5: a scan scoring 1 + ln(occurrences) per query word found (whole words).
        The query is plain text: its words are extracted, so FTS syntax in it is never parsed
        (no query raises); a query without letters or digits returns []."""
        if not isinstance(query, str):
            raise ValueError(f"query must be a str, got {type(query).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0, got {k!r}")
        with self._lock:
            self._check_open()
            return factdb.search(self._index, query, min(k, MAX_PAGE_INDEX))

    def count_facts(self) -> int:
        with self._lock:
            self._check_open()
            return factdb.count(self._index)

    # -- helpers ------------------------------------------------------------------------------
    def _known_id(self, fact_id: Any) -> int:
        fid = _fact_id(fact_id)
        if fid is None:
            with self._lock:
                self._check_open()
                raise self._unknown(fact_id)
        return fid

    def _unknown(self, fact_id: Any) -> UnknownFact:
        return UnknownFact(f"no fact {fact_id!r} in store {self.path}: never added, or forgotten (ids are "
                           f"never reused); {factdb.describe(self._index)}")


def _fact_id(fact_id: Any) -> int | None:
    """The id as an int (None: out of range, so no fact has it); ValueError for a non-integer.
    Integer types such as numpy.int64 (ids out of a vector index) are accepted."""
    try:
        if isinstance(fact_id, bool):
            raise TypeError
        fid = operator.index(fact_id)
    except TypeError:
        raise ValueError(f"a fact id is an int, got {type(fact_id).__name__} {fact_id!r}") from None
    return fid if 0 < fid <= MAX_PAGE_INDEX else None


def _utf8_len(value: str, what: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogates)") from None


def _check_text(text: Any) -> None:
    if not isinstance(text, str) or not text:
        raise ValueError(f"fact text must be a non-empty str, got {text!r:.60}")
    if _utf8_len(text, "fact text") > MAX_TEXT_BYTES:
        raise ValueError(f"fact text is {_utf8_len(text, 'fact text')} UTF-8 bytes; the limit is "
                         f"{MAX_TEXT_BYTES} (64 KiB): split it into several facts")


def _check_tags(tags: Any) -> list[str]:
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise ValueError(f"tags must be a sequence of str (e.g. a tuple), got {type(tags).__name__}")
    out = list(tags)
    if len(out) > MAX_TAGS:
        raise ValueError(f"a fact has at most {MAX_TAGS} tags, got {len(out)}")
    for tag in out:
        if not isinstance(tag, str) or not tag or _utf8_len(tag, "a tag") > MAX_TAG_BYTES:
            raise ValueError(f"each tag must be a non-empty str of at most {MAX_TAG_BYTES} UTF-8 bytes, "
                             f"got {tag!r:.60}")
    return out


def _check_label(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value or _utf8_len(value, what) > MAX_LABEL_BYTES:
        raise ValueError(f"{what} must be a non-empty str of at most {MAX_LABEL_BYTES} UTF-8 bytes, "
                         f"got {value!r:.60}")


def _check_kv_meta(n_tokens: Any, fingerprint: Any, rope: Any) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= MAX_PAGE_INDEX:
        raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
    _check_label(fingerprint, "fingerprint")
    _check_label(rope, "rope")


def _check_embedding(embedding: Any, embedder: Any) -> bytes | None:
    if embedding is None and embedder is None:
        return None
    if embedding is None or embedder is None:
        raise ValueError("give embedding and embedder together (or neither)")
    _check_label(embedder, "embedder")
    try:
        blob = bytes(memoryview(embedding).cast("B"))
    except (TypeError, ValueError):
        raise ValueError(f"embedding must be bytes or a C-contiguous buffer, got {type(embedding).__name__}") \
            from None
    if not blob or len(blob) > MAX_EMBEDDING_BYTES:
        raise ValueError(f"embedding is {len(blob)} bytes; it must hold 1 to {MAX_EMBEDDING_BYTES} (1 MiB)")
    return blob
