"""A store's memory facts: text, tags and the KV computed for them, on the store's keyed records.

A fact is one keyed record of the FACTS collection (factrows.py): its row holds the text, tags,
n_tokens, the model fingerprint and rope settings its KV was computed under and when it was made;
its blob is the KV (memory's FactKV bytes, opaque here); its index-only cache is the retrieval
embedding. The store keeps it durable, verified and rebuildable; this class gives it its meaning:
the limits, the checks on rows read back (a damaged fact is left out of listings with a
DamagedFactWarning and raises FactRowCorrupt by id), the older record forms, and lexical search
(factsearch.py). Errors are the fact flavours of the store's (facterrors.py).
Threading: as the Store's (its locks serialize writers); search keeps its own lock.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any, Iterator

from ..store import RecordCorrupt, RecordRowCorrupt, Store, StoredRow, UnknownRecord
from ..store.inputs import as_bytes_view
from . import factrows
from .facterrors import FactCorrupt, FactRowCorrupt, UnknownFact
from .factrows import FACTS, FactInfo
from .factsearch import FactSearch

_SAME_ON_REENCODE = ("text", "tags", "created")   # set_fact_kv carries these over from the record


class FactTable:
    """The facts of one store (add_fact, fact_kv, search_facts, ...)."""

    def __init__(self, store: Store):
        self.store = store
        self._search = FactSearch(lambda: [(f.id, f.text, f.tags) for f in self._sound(None, warn=True)])

    # -- write --------------------------------------------------------------------------------
    def add_fact(self, text: str, *, tags: Sequence[str] = (), n_tokens: int, fingerprint: str, rope: str,
                 kv: Any, embedding: bytes | None = None, embedder: str | None = None) -> int:
        """Store a fact (its text, tags, and the KV computed for it under model `fingerprint` with
        position encoding `rope`); returns its new id (ids only grow, never reused). Durable when
        it returns. Staged epochs, if any, are committed first."""
        factrows.check_text(text)
        tag_list = factrows.check_tags(tags)
        factrows.check_kv_meta(n_tokens, fingerprint, rope)
        cache = _embedding_cache(embedding, embedder)
        row = factrows.row_of(text, tag_list, n_tokens, fingerprint, rope, time.time())
        before = self.store.record_generation
        with _fact_errors():
            fid = self.store.put_record(FACTS, row, as_bytes_view(kv, "kv"), cache=cache)
        self._search.changed(before, self.store.record_generation, put=(fid, text, tuple(tag_list)))
        return fid

    def set_fact_kv(self, fact_id: int, *, n_tokens: int, fingerprint: str, rope: str, kv: Any) -> None:
        """Replace a fact's KV (re-encoded under another model); the old record becomes dead bytes
        for compaction. Durable when it returns. It also repairs a row damaged only in the fields
        it rewrites (n_tokens, fingerprint, rope); other row damage, or a text edited since the old
        KV was bound to it, raises FactRowCorrupt (forget the fact)."""
        factrows.check_kv_meta(n_tokens, fingerprint, rope)
        view = as_bytes_view(kv, "kv")
        with _fact_errors():
            found = self.store.records(FACTS, [fact_id])
            if not found:
                raise UnknownFact(f"no fact {fact_id!r} in store {self.store.path}: never added, or forgotten "
                                  f"(ids are never reused)")
            raw = found[0].raw
            why = "row: not a JSON object" if raw is None else factrows.damage(raw, factrows.REWRITTEN_BY_SET_KV)
            if why:
                raise FactRowCorrupt(found[0].id, why)
            self._check_binding(found[0].id, raw["text"])
            row = factrows.row_of(raw["text"], list(raw["tags"]), n_tokens, fingerprint, rope, float(raw["created"]))
            self.store.replace_record(FACTS, found[0].id, row, view, same=_SAME_ON_REENCODE)

    def set_fact_embedding(self, fact_id: int, embedding: bytes | None, embedder: str | None) -> None:
        """Set (or, with None, None: clear) a fact's retrieval embedding, an opaque blob."""
        cache = _embedding_cache(embedding, embedder)
        with _fact_errors():
            self.store.set_record_cache(FACTS, fact_id, cache)

    def forget_fact(self, fact_id: int) -> None:
        """Delete a fact (UnknownFact if there is none); compaction reclaims its KV record. A small
        forget record goes to the log (durable when this returns), so a rebuilt index forgets it too."""
        before = self.store.record_generation
        with _fact_errors():
            self.store.forget_record(FACTS, fact_id)
        self._search.changed(before, self.store.record_generation, drop=int(fact_id))

    # -- read ---------------------------------------------------------------------------------
    def facts(self, ids: Iterable[int] | None = None) -> list[FactInfo]:
        """Every fact, or those of `ids` that exist (unknown ids are left out), ordered by id. A
        fact whose row is damaged is left out too, with a DamagedFactWarning naming it."""
        return self._sound(None if ids is None else list(ids), warn=True)

    def stored(self, ids: Iterable[int]) -> set[int]:
        """Those of ids the store holds (damaged facts included): what was not forgotten."""
        with _fact_errors():
            return {r.id for r in self.store.records(FACTS, list(ids))}

    def fact_kv(self, fact_id: int) -> bytes:
        """A fact's KV bytes, after checking its row and verifying its record (tag; kind / fact id /
        KV version / length equal the row; its row, text included, equal to the index's). A damaged
        row or an edited text raises FactRowCorrupt; a damaged record FactCorrupt."""
        with _fact_errors():
            found = self.store.records(FACTS, [fact_id])
            why = _damage(found[0]) if found else None
            if why:
                raise FactRowCorrupt(found[0].id, why)
            rec = self.store.record(FACTS, fact_id)
            why = factrows.damage(rec.row)
            if why:
                raise FactRowCorrupt(rec.id, why)
            try:
                return factrows.unbind(rec.blob, rec.row["text"], rec.headless)
            except ValueError as exc:
                raise FactRowCorrupt(rec.id, f"text: {exc}") from None

    def damaged_facts(self) -> list[tuple[int, str]]:
        """(id, why) of every fact whose row fails its checks: the facts that `facts` leaves out.
        Edited texts are found by reading the records (fact_kv, `capsule verify`)."""
        with _fact_errors():
            rows = self.store.records(FACTS)
        return [(r.id, why) for r in rows if (why := _damage(r))]

    def fact_embeddings(self) -> list[tuple[int, str, bytes]]:
        """(id, embedder, embedding) of every sound fact that has an embedding, ordered by id."""
        with _fact_errors():
            caches = self.store.record_caches(FACTS)
        sound = {f.id for f in self._sound(None, warn=True)} if caches else set()
        out = []
        for fid, blob in caches:
            got = factrows.decode_embedding(blob) if fid in sound else None
            if got is not None:
                out.append((fid, got[0], got[1]))
        return out

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
        with _fact_errors():
            return self._search.search(query, min(k, 1 << 62), self.store.record_generation)

    def count_facts(self) -> int:
        """How many facts the store holds (damaged rows included)."""
        return self.store.count_records(FACTS)

    # -- helpers ------------------------------------------------------------------------------
    def _sound(self, ids: list[int] | None, warn: bool) -> list[FactInfo]:
        with _fact_errors():
            rows = self.store.records(FACTS, ids)
        out = []
        for r in rows:
            why = _damage(r)
            if why is None:
                out.append(factrows.info(r.id, r.row))  # type: ignore[arg-type]
            elif warn:
                factrows.warn_damaged(r.id, f"its index row is damaged ({why})")
        return out

    def _check_binding(self, fact_id: int, text: str) -> None:
        """A record written before format 3 binds its KV to its text by a hash: re-encoding must
        not launder an edited text. A damaged record is not checked (re-encoding is its repair)."""
        try:
            rec = self.store.record(FACTS, fact_id)
        except (RecordCorrupt, RecordRowCorrupt):
            return
        if rec.headless:
            try:
                factrows.unbind(rec.blob, text, True)
            except ValueError as exc:
                raise FactRowCorrupt(fact_id, f"text: {exc}") from None


def _damage(r: StoredRow) -> str | None:
    """Why a stored row is not a sound fact, naming the field where one can be named."""
    if r.row is not None:
        return factrows.damage(r.row)
    return (factrows.damage(r.raw) if r.raw is not None else None) or r.damage


def _embedding_cache(embedding: Any, embedder: Any) -> bytes | None:
    if embedding is None and embedder is None:
        return None
    if embedding is None or embedder is None:
        raise ValueError("give embedding and embedder together (or neither)")
    return factrows.encode_embedding(embedder, embedding)


@contextlib.contextmanager
def _fact_errors() -> Iterator[None]:
    """The store's keyed-record errors, said of facts."""
    try:
        yield
    except (UnknownFact, FactCorrupt, FactRowCorrupt):
        raise
    except UnknownRecord as exc:
        raise UnknownFact(str(exc).replace("never put", "never added")) from None
    except RecordCorrupt as exc:
        raise FactCorrupt(exc.index, exc.version, exc.segment, exc.offset, exc.reason) from None  # type: ignore
    except RecordRowCorrupt as exc:
        raise FactRowCorrupt(exc.record_id, exc.reason) from None
