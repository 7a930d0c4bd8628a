"""A Session's persistent memory: remember / forget / recall facts, and their K/V for injection.

Facts live in the session's store as keyed records (facttable.py: text, tags and the embedding in
the index, pre-RoPE K/V in the segment log), so they survive processes and power cuts. Retrieval
needs no extra model: FTS5 BM25 over the texts (factsearch.py), fused with cosine similarity
when an embedder (MiniLM) is present.

Threading: not thread-safe on its own; the Session serializes calls.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..errors import CapsuleCorrupt, StoreError
from ..store import Store
from ..llm.model import Decoder
from ..tokenize import ReferenceTokenizer
from .embedder import Embedder, load_embedder
from .encode import FactKV, encode_fact
from .facterrors import DamagedFactWarning, UnknownFact
from .facttable import FactTable
from .config import MemoryConfig
from .ranking import EmbeddingIndex, fuse

__all__ = ["Fact", "Memory", "MemoryConfig"]


@dataclass(frozen=True)
class Fact:
    """A recalled fact: its id, text, fused retrieval score (higher is better) and tags."""
    id: int
    text: str
    score: float
    tags: tuple[str, ...]


class Memory:
    """The facts of one store, encoded for one model."""

    def __init__(self, store: Store, model: Decoder, tokenizer: ReferenceTokenizer,
                 config: MemoryConfig, model_fingerprint: str) -> None:
        # store: the facts of the session's store (a FactTable over its keyed records)
        self.store = store if isinstance(store, FactTable) else FactTable(store)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        cfg = model.cfg
        # K/V depend on the weights and their dtype; the rope settings say how keys rotate
        self.fingerprint = f"{model_fingerprint}:{str(model.dtype).replace('torch.', '')}"
        self.rope = json.dumps(dataclasses.asdict(cfg.rope), sort_keys=True)
        self._expect = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        self._kv: OrderedDict[int, FactKV] = OrderedDict()
        self._embedder: Embedder | None | bool = False     # False: not loaded yet
        self._index: EmbeddingIndex | None = None

    # -- write --------------------------------------------------------------------------------
    def remember(self, text: str, tags: Sequence[str] | None = None,
                 context_ids: Sequence[int] = ()) -> int:
        """Encode a fact once (pre-RoPE K/V) and store it durably; returns its id."""
        if tags is not None and (isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Iterable)):
            raise ValueError(f"tags must be a list of str, e.g. ['kitchen'], got {type(tags).__name__} "
                             f"{tags!r:.60}")
        ids = self._fact_ids(text)
        ctx = list(context_ids)[-self.config.window:] if self.config.window else []
        kv = encode_fact(self.model, ids, ctx)
        emb = self._embed([text])
        return self._add(text, tuple(tags or ()), kv, None if emb is None else emb[0])

    def adopt(self, text: str, tags: Sequence[str], kv: bytes | None, embedding: tuple[str, bytes] | None) -> int:
        """Add a fact that came from elsewhere (fleet memory): its K/V under this model when given
        and valid for it (checked like a stored one), else encoded here from the text; its
        embedding kept when it is this embedder's. Returns its id."""
        ids = self._fact_ids(text)
        fact = None
        if kv is not None:
            try:
                fact = FactKV.from_bytes(kv, expect=self._expect)
            except ValueError:
                fact = None                   # another shape or damaged: encode it here instead
        fact = fact if fact is not None else encode_fact(self.model, ids, [])
        vec = None
        if self._embed([]) is not None:       # theirs when it is this embedder's, else computed here
            if embedding is not None and embedding[0] == self._embedder.name and len(embedding[1]) == 4 * self._embedder.dim:
                vec = torch.from_numpy(np.frombuffer(embedding[1], dtype="<f4").copy())
            else:
                vec = self._embed([text])[0]
        return self._add(text, tuple(tags), fact, vec)

    def _add(self, text: str, tags: tuple[str, ...], kv: FactKV, vec: torch.Tensor | None) -> int:
        """Store a fact whose K/V is this model's, with its embedding (dim,) when there is an
        embedder; keep the caches in step."""
        fid = self.store.add_fact(text, tags=tags, n_tokens=kv.n_tokens, fingerprint=self.fingerprint,
                                  rope=self.rope, kv=kv.to_bytes(),
                                  embedding=None if vec is None else vec.numpy().astype("<f4").tobytes(),
                                  embedder=None if vec is None else self._embedder.name)
        self._cache(fid, kv)
        if vec is not None and self._index is not None:
            self._index.add([fid], vec[None])
        return fid

    def forget(self, fact_id: int) -> None:
        self.store.forget_fact(_fact_id(fact_id))
        self._kv.pop(fact_id, None)
        if self._index is not None:
            self._index.remove([fact_id])

    def reencode(self, progress: Any = None) -> tuple[int, list[tuple[int, str]]]:
        """Re-encode every fact stored under another model or rope, or whose K/V record is
        damaged (from its text). Returns (how many, [(fact id, why it could not be)]); one
        failure does not stop the others. progress: called with the number of facts checked."""
        failed = [(fid, f"its index row is damaged ({why}): forget it and remember it again")
                  for fid, why in self.store.damaged_facts()]
        done = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DamagedFactWarning)   # in `failed` already
            infos = self.store.facts()
        for i, info in enumerate(infos, 1):
            try:
                if (info.fingerprint, info.rope) != (self.fingerprint, self.rope) or not self._intact(info):
                    self._reencode(info)
                    done += 1
            except UnknownFact:
                pass                                    # forgotten meanwhile
            except (CapsuleCorrupt, StoreError, ValueError, RuntimeError, MemoryError) as exc:
                failed.append((info.id, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            if progress is not None:
                progress(i)
        return done, failed

    def _intact(self, info: Any) -> bool:
        try:
            kv = FactKV.from_bytes(self.store.fact_kv(info.id), expect=self._expect)
        except (CapsuleCorrupt, ValueError):
            return False
        return kv.n_tokens == info.n_tokens

    # -- read ---------------------------------------------------------------------------------
    def recall(self, query: str, k: int = 8) -> list[Fact]:
        """Top-k facts for query: BM25 over texts, fused with cosine when an embedder is present."""
        if not isinstance(query, str):
            raise ValueError(f"query must be a str, got {type(query).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0, got {k!r}")
        if k == 0 or not query.strip():
            return []
        lexical = self.store.search_facts(query, 4 * k)
        semantic: list[tuple[int, float]] = []
        emb = self._embed([query])
        if emb is not None:
            semantic = self._loaded_index().search(emb[0], 4 * k)
        ranked = fuse(lexical, semantic, k)
        infos = {f.id: f for f in self.store.facts([i for i, _ in ranked])}
        return [Fact(i, infos[i].text, s, infos[i].tags) for i, s in ranked if i in infos]

    def kv(self, fact_id: int) -> FactKV | None:
        """The fact's K/V for this model (re-encoded once if stored under another); None, with a
        warning, when its record is damaged: a damaged fact is never injected."""
        got = self._kv.get(fact_id)
        if got is not None:
            self._kv.move_to_end(fact_id)
            return got
        infos = self.store.facts([fact_id])
        if not infos:
            return None
        info = infos[0]
        try:   # a fact forgotten meanwhile (UnknownFact) is simply not injected

            if (info.fingerprint, info.rope) != (self.fingerprint, self.rope):
                return self._reencode(info)
            kv = FactKV.from_bytes(self.store.fact_kv(fact_id), expect=self._expect)
            if kv.n_tokens != info.n_tokens:
                raise ValueError(f"holds {kv.n_tokens} tokens, its row says {info.n_tokens}")
        except UnknownFact:
            return None
        except (CapsuleCorrupt, ValueError) as exc:
            warnings.warn(f"memory fact {fact_id} is damaged and was skipped: {exc} (`capsule memory "
                          "reencode STORE --model M` re-encodes it from its text)", stacklevel=3)
            return None
        self._cache(fact_id, kv)
        return kv

    def count(self) -> int:
        return self.store.count_facts()

    def stored(self, ids: Iterable[int]) -> set[int]:
        """Those of ids the store still holds (not forgotten; damaged facts included)."""
        return self.store.stored(ids)

    def embedding_index(self) -> EmbeddingIndex | None:
        """The cosine index over every fact's embedding (loaded on first use, facts embedded by
        another model redone); None without an embedder."""
        if self._embed([]) is None:
            return None
        return self._loaded_index()

    # -- internals ----------------------------------------------------------------------------
    def _fact_ids(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a fact must be a non-empty str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"a fact must be valid Unicode text: it holds {exc.object[exc.start:exc.end]!r} "
                             f"at index {exc.start} (an unpaired surrogate)") from None
        ids = self.tokenizer.encode(text)
        if len(ids) > self.config.max_fact_tokens:
            raise ValueError(f"the fact is {len(ids)} tokens; the limit is "
                             f"{self.config.max_fact_tokens} (MemoryConfig.max_fact_tokens)")
        return ids

    def _reencode(self, info: Any) -> FactKV:
        # the fact was accepted when remembered: a lower max_fact_tokens now does not refuse it
        # (one too long for a region is left out at injection, with a warning)
        ids = self.tokenizer.encode(info.text) if isinstance(info.text, str) else []
        if not ids:
            raise ValueError(f"fact {info.id} has no text to encode")
        kv = encode_fact(self.model, ids)   # the context window is not stored
        self.store.set_fact_kv(info.id, n_tokens=kv.n_tokens, fingerprint=self.fingerprint,
                               rope=self.rope, kv=kv.to_bytes())
        self._cache(info.id, kv)
        return kv

    def _cache(self, fact_id: int, kv: FactKV) -> None:
        if self.config.cache_facts:
            self._kv[fact_id] = kv
            while len(self._kv) > self.config.cache_facts:
                self._kv.popitem(last=False)

    def _embed(self, texts: list[str]) -> torch.Tensor | None:
        if self._embedder is False:
            self._embedder = load_embedder(self.config.embedder, device=self.model.device)
        return None if self._embedder is None else self._embedder.embed(texts)

    def _loaded_index(self) -> EmbeddingIndex:
        """Every fact's embedding stacked once; facts embedded by another model are redone."""
        if self._index is None:
            emb = self._embedder
            index = EmbeddingIndex(emb.dim, device=self.model.device)   # cosine top-k where the model runs
            have = {}
            for fid, name, blob in self.store.fact_embeddings():
                if name == emb.name and len(blob) == 4 * emb.dim:
                    have[fid] = np.frombuffer(blob, dtype="<f4")
            if have:
                index.add(list(have), np.stack(list(have.values())))
            missing = [f for f in self.store.facts() if f.id not in have]
            for i in range(0, len(missing), 64):
                part = missing[i:i + 64]
                vecs = emb.embed([f.text for f in part])
                index.add([f.id for f in part], vecs)
                for f, v in zip(part, vecs):
                    try:
                        self.store.set_fact_embedding(f.id, v.numpy().astype("<f4").tobytes(),
                                                      emb.name)
                    except StoreError:
                        pass   # forgotten meanwhile: the index entry goes with the next forget
            self._index = index
        return self._index


def _fact_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"fact ids are ints >= 1, got {value!r}")
    return value
