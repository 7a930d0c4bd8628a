"""A disk-cache-served tokenizer's parts: identity and decoding now, the encoder on first need."""
from __future__ import annotations

import threading
from typing import Callable, Sequence

from ..errors import TokenizerError
from . import disk_cache
from .families import Parts


class LazyParts:
    """The full reference of a cache-served tokenizer, built once: on first need or by prefetch.

    One lock: an on-demand build racing the prefetch thread waits for it instead of building twice.
    """

    __slots__ = ("_build", "_check", "_parts", "_lock", "_started")

    def __init__(self, build: Callable[[], Parts], check: Callable[[Parts], None]) -> None:
        self._build, self._check = build, check
        self._parts: Parts | None = None
        self._lock = threading.Lock()
        self._started = False

    @property
    def built(self) -> Parts | None:
        return self._parts

    def get(self) -> Parts:
        parts = self._parts
        if parts is None:
            with self._lock:
                parts = self._parts
                if parts is None:
                    parts = self._build()
                    self._check(parts)
                    self._parts = parts
        return parts

    def prefetch(self) -> None:
        if not self._started and self._parts is None:   # a racing second thread only waits
            self._started = True
            threading.Thread(target=self._quiet_get, name="capsule-tokenizer-prefetch",
                             daemon=True).start()

    def _quiet_get(self) -> None:
        try:
            self.get()
        except Exception:   # the on-demand build retries and raises where a caller can handle it
            pass


def cached_parts(name: str, cached: disk_cache.Cached, ent: disk_cache.Entry,
                 build: Callable[[], Parts]) -> tuple[Parts, LazyParts]:
    """Parts served from ``cached``; encode and piece_spans build the full reference first."""
    def check(full: Parts) -> None:   # the cache must describe what the files build
        if not disk_cache.unchanged(ent):
            raise TokenizerError(f"{name}: the tokenizer files changed on disk after it was "
                                 "loaded; call clear_cache() and load it again")
        if ((full.max_id, dict(full.special_tokens), full.pattern, full.normalization,
             full.eos_ids, full.byte_level, full.piece_spans is not None, full.pipeline)
                != (cached.max_id, cached.special_tokens, cached.pattern, cached.normalization,
                    cached.eos_ids, cached.byte_level, cached.pieces, cached.pipeline)):
            disk_cache.discard(ent)
            raise TokenizerError(f"{name}: the tokenizer cache {ent.folder} disagreed with the "
                                 "tokenizer files and was removed; call clear_cache() and load "
                                 "it again")

    lazy = LazyParts(build, check)

    def pieces(t: str) -> list[tuple[int, int]]:
        fn = lazy.get().piece_spans
        assert fn is not None   # check() matched cached.pieces
        return fn(t)

    table = cached.table

    def decode_bytes(ids: Sequence[int]) -> bytes:
        # The table needs no encoder; once one is built its decoder is faster on long sequences
        # (tiktoken: 0.07 vs 1 ms for 4K ids) and equal by construction of the table.
        full = lazy.get() if table is None else lazy.built
        return full.decode_bytes(ids) if full is not None else table.decode_bytes(ids)

    parts = Parts(encode=lambda t: lazy.get().encode(t), decode_bytes=decode_bytes,
                  max_id=cached.max_id, special_tokens=cached.special_tokens,
                  pattern=cached.pattern, normalization=cached.normalization,
                  eos_ids=cached.eos_ids, fingerprint=lambda: cached.fingerprint,
                  piece_spans=pieces if cached.pieces else None, byte_level=cached.byte_level,
                  pipeline=cached.pipeline)
    return parts, lazy
