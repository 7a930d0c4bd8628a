"""Persistent memory facts on the Store: one index row (+ its full-text row) and one KV record each.

A KV write (add_fact, set_fact_kv) follows the epoch commit protocol through
Committer.commit_record: staged epochs commit first, then append the KIND_FACT record -> fsync
-> ONE index transaction. forget_fact and set_fact_embedding touch only the index (one
transaction each). Writers hold the writer lock; readers only the state lock. A fact record is
bound to its fact id and KV version (record index / epoch fields), so no other record can stand
in for it, and to the fact's text (a sha256 before the KV bytes), so an edited text is detected.
Rows read back are checked (factrows.py): a damaged one is left out of listings with a
DamagedFactWarning and raises FactRowCorrupt where it is asked for by id.
Format and invariants: docs/FORMAT.md, "Facts".
"""
from __future__ import annotations

import operator
import threading
import time
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Callable

from .. import safejson
from . import factdb, factrecord, factrows
from .factrecord import FactMeta
from .errors import FactCorrupt, FactRowCorrupt, UnknownFact
from .factrows import check_embedding, check_kv_meta, check_tags, check_text
from .info import FactInfo
from .inputs import as_bytes_view
from .reader import check_record, check_ref
from .records import FACT_REGION, KIND_FACT, KIND_FORGET, MAX_EPOCH, MAX_PAGE_INDEX, RecordError, Sealer
from .segments import SegmentReader

if TYPE_CHECKING:
    from .commit import Committer
    from .index import Index


class Facts:
    """The fact half of a Store: one object holding the parts it shares with the store (its locks,
    committer, sealer, folder) and reading the store's current index through `index` (a rebuild
    replaces it). Store exposes these methods as its own (add_fact, fact_kv, ...)."""

    def __init__(self, path: Path, seg_dir: Path, sealer: Sealer, commit: Committer, wlock: threading.RLock,
                 lock: threading.RLock, index: Callable[[], Index], check_open: Callable[[], None]):
        self.path, self._seg_dir, self._sealer, self._commit = path, seg_dir, sealer, commit
        self._wlock, self._lock, self._current_index, self._check_open = wlock, lock, index, check_open

    @property
    def _index(self) -> Index:
        return self._current_index()

    # -- write --------------------------------------------------------------------------------
    def add_fact(self, text: str, *, tags: Sequence[str] = (), n_tokens: int, fingerprint: str, rope: str,
                 kv: Any, embedding: bytes | None = None, embedder: str | None = None) -> int:
        """Store a fact (its text, tags, and the KV computed for it under model `fingerprint` with
        position encoding `rope`); returns its new id (ids only grow, never reused). Durable when
        it returns. Staged epochs, if any, are committed first."""
        check_text(text)
        tag_list = check_tags(tags)
        check_kv_meta(n_tokens, fingerprint, rope)
        emb = check_embedding(embedding, embedder)
        created = time.time()
        data = factrecord.encode(FactMeta(self._commit.store_id, text, tuple(tag_list), n_tokens, fingerprint,
                                          rope, created), as_bytes_view(kv, "kv"))
        with self._wlock:
            self._check_open()
            with self._lock:
                fact_id = factdb.next_id(self._index)
            self._commit.commit_record(
                KIND_FACT, 1, FACT_REGION, fact_id, data, f"writing fact {fact_id}",
                lambda c, ref: factdb.insert(c, fact_id, text, tag_list, n_tokens, fingerprint, rope, created,
                                             ref, emb, embedder))
            return fact_id

    def set_fact_kv(self, fact_id: int, *, n_tokens: int, fingerprint: str, rope: str, kv: Any) -> None:
        """Replace a fact's KV (re-encoded under another model); the old record becomes dead
        bytes for compaction. Durable when it returns. It also repairs a row damaged only in the
        fields it rewrites (n_tokens, fingerprint, rope, KV location); other row damage, or a text
        edited since the old KV was bound to it, raises FactRowCorrupt (forget the fact)."""
        fid = self._known_id(fact_id)
        check_kv_meta(n_tokens, fingerprint, rope)
        view = as_bytes_view(kv, "kv")
        with self._wlock:
            self._check_open()
            with self._lock:
                row = factdb.row(self._index, fid)
                if row is None:
                    raise self._unknown(fid)
                why = factrows.damage(row, factrows.REWRITTEN_BY_SET_KV)
                if why is None:
                    why = self._text_edited(row)
            if why:
                raise FactRowCorrupt(fid, why)
            if row.kv_version >= MAX_EPOCH:
                raise ValueError(f"fact {fid} was re-encoded {row.kv_version} times; add it as a new fact")
            data = factrecord.encode(FactMeta(self._commit.store_id, row.text, tuple(factrows.parse_tags(row.tags)),
                                              n_tokens, fingerprint, rope, float(row.created)), view)
            self._commit.commit_record(
                KIND_FACT, row.kv_version + 1, FACT_REGION, fid, data, f"re-encoding fact {fid}",
                lambda c, ref: factdb.set_kv(c, fid, n_tokens, fingerprint, rope, ref))

    def set_fact_embedding(self, fact_id: int, embedding: bytes | None, embedder: str | None) -> None:
        """Set (or, with None, None: clear) a fact's retrieval embedding, an opaque blob."""
        fid = self._known_id(fact_id)
        emb = check_embedding(embedding, embedder)
        self._index_only(fid, f"setting the embedding of fact {fid}",
                         lambda c: factdb.set_embedding(c, fid, emb, embedder))

    def forget_fact(self, fact_id: int) -> None:
        """Delete a fact (UnknownFact if there is none); compaction reclaims its KV record. A small
        forget record goes to the log (durable when this returns), so a rebuilt index forgets it too."""
        fid = self._known_id(fact_id)
        with self._wlock:
            self._check_open()
            with self._lock:
                if not factdb.exists(self._index, fid):
                    raise self._unknown(fid)
            self._commit.commit_record(
                KIND_FORGET, 1, FACT_REGION, fid, safejson.dumps({"store": self._commit.store_id}),
                f"forgetting fact {fid}", lambda c, ref: factdb.forget(c, fid, ref))

    def _index_only(self, fid: int, what: str, apply: Any) -> None:
        with self._wlock, self._lock:
            self._check_open()
            if not factdb.exists(self._index, fid):
                raise self._unknown(fid)
            self._index.write(what, apply)

    # -- read ---------------------------------------------------------------------------------
    def facts(self, ids: Iterable[int] | None = None) -> list[FactInfo]:
        """Every fact, or those of `ids` that exist (unknown ids are left out), ordered by id. A
        fact whose row is damaged is left out too, with a DamagedFactWarning naming it."""
        wanted = None if ids is None else [i for i in map(_fact_id, ids) if i is not None]
        with self._lock:
            self._check_open()
            return factdb.infos(self._index, wanted)

    def fact_kv(self, fact_id: int) -> bytes:
        """A fact's KV bytes, after checking its row and verifying its record (tag; kind / fact id /
        KV version / length equal the row; bound to the row's text). A damaged row or an edited
        text raises FactRowCorrupt; a damaged record FactCorrupt (a PageCorrupt, region "fact")."""
        fid = self._known_id(fact_id)
        with self._lock:
            self._check_open()
            row = factdb.row(self._index, fid)
            if row is None:
                raise self._unknown(fid)
            why = factrows.damage(row)
            if why:
                raise FactRowCorrupt(fid, why)
            payload = self._record(row)
            try:
                return bytes(factrecord.unbind(payload, row.text)[0])   # the one copy out of the map
            except ValueError as exc:
                raise FactRowCorrupt(fid, f"text: {exc}") from None

    def damaged_facts(self) -> list[tuple[int, str]]:
        """(id, why) of every fact whose row fails its checks: the facts that `facts` leaves out.
        Edited texts are found by reading the records (fact_kv, `capsule verify`)."""
        with self._lock:
            self._check_open()
            return [(r.id, why) for r in factdb.rows(self._index) if (why := factrows.damage(r))]

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
    def _record(self, row: factrows.FactRow) -> memoryview:
        """The payload of the row's verified KV record (a view of the map; FactCorrupt if bad).
        The caller holds the state lock."""
        ref = factdb.ref_of(row)
        with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
            try:
                check_ref(ref)
                view = segs.view(ref.segment, ref.offset, ref.length)  # type: ignore[arg-type]
                return check_record(view, ref, self._sealer)
            except RecordError as exc:
                raise FactCorrupt(row.id, ref.rec_epoch, ref.segment, ref.offset, str(exc)) from None

    def _text_edited(self, row: factrows.FactRow) -> str | None:
        """Why the row's text is not the one its current KV record is bound to; None when it is,
        or when that cannot be told (an unbound or damaged record: re-encoding replaces it)."""
        try:
            factrecord.unbind(self._record(row), row.text)
        except FactCorrupt:
            return None
        except ValueError as exc:
            return f"text: {exc}"
        return None

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
