"""IncrementalTokenizer state as (JSON-able meta, byte blobs), and its validated parse.

The text and ids are written once, as fixed-size chunks at absolute offsets plus the last,
partial chunk: blobs ``text/<k>`` (chars ``k*CHUNK_CHARS`` on, UTF-8) and ``ids/<k>`` (ids
``k*CHUNK_IDS`` on, uint32 little-endian: one 4 KiB host page each), then ``text`` and ``ids``
(what is left). An edit changes only the chunks from its seam on, so a capsule's pages change
only there; ``ChunkCache`` keeps the bytes of complete chunks no edit touched since, so a
checkpoint serializes only what changed. The only boundary kept is the tail's start (meta
``base``); the boundaries after it are recomputed on restore, never trusted. A parse trusts
nothing it can check cheaply: types, sizes, ranges, the vocabulary's fingerprint, the layout.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Mapping

FORMAT = "capsule.tokenize.incremental/2"
CHUNK_IDS = 1024      # ids per chunk: 4 KiB, one host page of a capsule
CHUNK_CHARS = 4096    # chars per text chunk: one page of ASCII
STATS = ("appends", "windows", "widenings", "fallbacks", "check_failures", "window_chars")


class ChunkCache:
    """Bytes of the complete chunks no edit touched since they were serialized."""

    def __init__(self) -> None:
        self.text: list[bytes] = []
        self.ids: list[bytes] = []

    def touch(self, char: int, token: int) -> None:
        """Text from ``char`` on and ids from ``token`` on changed."""
        del self.text[max(0, char) // CHUNK_CHARS:]
        del self.ids[max(0, token) // CHUNK_IDS:]


def le(a: array) -> bytes:
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def from_le(code: str, data: Any, what: str) -> array:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"tokenizer state blob {what!r} must be bytes, not {type(data).__name__}")
    a = array(code)
    if len(data) % a.itemsize:
        raise ValueError(f"tokenizer state blob {what!r} has {len(data)} bytes, not a multiple "
                         f"of {a.itemsize}")
    a.frombytes(bytes(data))
    if sys.byteorder == "big":
        a.byteswap()
    return a


def meta(ref: Any, chars: int, tokens: int, base: tuple[int, int], full_mode: bool, rate: float,
         stats: Mapping[str, int]) -> dict:
    """The JSON-able half of a state (``parse`` reads it back)."""
    return {"format": FORMAT, "tokenizer": ref.name, "fingerprint": ref.fingerprint,
            "chars": chars, "tokens": tokens, "chunk_chars": CHUNK_CHARS, "chunk_ids": CHUNK_IDS,
            "base": list(base), "full_mode": bool(full_mode), "shadow_rate": rate,
            "stats": {k: int(stats[k]) for k in STATS}}


def chunk_blobs(text_slice: Callable[[int, int], str], ids_slice: Callable[[int, int], list[int]],
                n_chars: int, n_tokens: int, cache: ChunkCache) -> dict[str, bytes]:
    """The text and ids as chunk blobs; complete chunks come from (and go into) the cache."""
    blobs: dict[str, bytes] = {}
    for name, cached, size, total, make in (
            ("text", cache.text, CHUNK_CHARS, n_chars,
             lambda lo, hi: text_slice(lo, hi).encode("utf-8", "surrogatepass")),
            ("ids", cache.ids, CHUNK_IDS, n_tokens, lambda lo, hi: le(array("I", ids_slice(lo, hi))))):
        full = total // size
        del cached[full:]
        for k in range(len(cached), full):      # only chunks an edit reached since
            cached.append(make(k * size, (k + 1) * size))
        for k, blob in enumerate(cached):
            blobs[f"{name}/{k}"] = blob
        blobs[name] = make(full * size, total)
    return blobs


def stream_blobs(blobs: Mapping[str, bytes]) -> dict[str, dict[str, bytes]]:
    """Each stream's tokenizer blobs under the tokenizer's own keys ("ids", "ids/3", "text", ...),
    from a capsule's host blobs ("ids/<stream>", "ids.3/<stream>", "text/<stream>", ...)."""
    out: dict[str, dict[str, bytes]] = {}
    for key, blob in blobs.items():
        kind, _, name = key.partition("/")
        base, _, k = kind.partition(".")
        if base in ("ids", "text"):
            out.setdefault(name, {})[f"{base}/{k}" if k else base] = blob
    return out


@dataclass(frozen=True)
class Saved:
    """A parsed, checked state (the tail's ids are checked against the reference later)."""
    text: str
    ids: array
    base: tuple[int, int]            # (char offset, token count) of the tail's first boundary
    full_mode: bool
    shadow_rate: Any
    stats: dict[str, int]
    cache: ChunkCache                # the complete chunks' bytes, as read


def _int(meta: Mapping[str, Any], key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"tokenizer state meta {key!r} must be an int >= 0, not {v!r}")
    return v


def parse(tokenizer: Any, meta: Mapping[str, Any], blobs: Mapping[str, Any],
          verify: bool = False) -> Saved:
    """Check a state against ``tokenizer`` (a ReferenceTokenizer); ValueError naming what is off.
    verify: the whole text's reference ids must be the saved ones (O(n))."""
    if not isinstance(meta, Mapping) or not isinstance(blobs, Mapping):
        raise ValueError("tokenizer state must be a (meta dict, blobs dict) pair")
    if meta.get("format") != FORMAT:
        raise ValueError(f"tokenizer state format {meta.get('format')!r} is not {FORMAT!r}")
    fp = meta.get("fingerprint")
    if not isinstance(fp, str) or fp != tokenizer.fingerprint:
        raise ValueError(f"tokenizer state was taken with vocabulary {meta.get('tokenizer')!r} "
                         f"(fingerprint {str(fp)[:16]}...), not {tokenizer.name!r} "
                         f"({tokenizer.fingerprint[:16]}...)")
    n_chars, n_tokens = _int(meta, "chars"), _int(meta, "tokens")
    if meta.get("chunk_chars") != CHUNK_CHARS or meta.get("chunk_ids") != CHUNK_IDS:
        raise ValueError(f"tokenizer state chunks are {meta.get('chunk_chars')!r} chars / "
                         f"{meta.get('chunk_ids')!r} ids, not {CHUNK_CHARS} / {CHUNK_IDS}")
    full = meta.get("full_mode", False)
    if not isinstance(full, bool):
        raise ValueError(f"tokenizer state meta 'full_mode' must be a bool, not {full!r}")
    base = meta.get("base")
    if not (isinstance(base, list) and len(base) == 2 and all(type(x) is int for x in base)) \
            or not (0 <= base[0] <= n_chars and 0 <= base[1] <= n_tokens) or (base[0] == 0) != (base[1] == 0):
        raise ValueError(f"tokenizer state meta 'base' {str(base)[:40]} is not a (char offset, "
                         "token count) pair inside the text")
    n_tc, n_ic = n_chars // CHUNK_CHARS, n_tokens // CHUNK_IDS
    expected = {"text", "ids", *(f"text/{k}" for k in range(n_tc)), *(f"ids/{k}" for k in range(n_ic))}
    if set(blobs) != expected:
        odd = sorted(set(blobs) ^ expected)[:3]
        raise ValueError(f"tokenizer state blobs do not match its {n_chars} chars and {n_tokens} "
                         f"ids in chunks: {odd} missing or unexpected")
    cache = ChunkCache()
    parts = []
    for k in range(n_tc + 1):
        raw = blobs[f"text/{k}" if k < n_tc else "text"]
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ValueError("tokenizer state text blobs must be bytes")
        try:
            part = bytes(raw).decode("utf-8", "surrogatepass")   # tiktoken accepts lone ones
        except UnicodeDecodeError as exc:
            raise ValueError(f"tokenizer state text is not valid UTF-8: {exc}") from exc
        if len(part) != (CHUNK_CHARS if k < n_tc else n_chars - n_tc * CHUNK_CHARS):
            raise ValueError(f"tokenizer state text chunk {k} holds {len(part)} chars; the meta's "
                             f"{n_chars} chars need another size")
        parts.append(part)
        if k < n_tc:
            cache.text.append(bytes(raw))
    text = "".join(parts)
    del parts
    ids = array("I")
    for k in range(n_ic + 1):
        key = f"ids/{k}" if k < n_ic else "ids"
        part = from_le("I", blobs[key], key)
        if len(part) != (CHUNK_IDS if k < n_ic else n_tokens - n_ic * CHUNK_IDS):
            raise ValueError(f"tokenizer state ids chunk {k} holds {len(part)} ids; the meta's "
                             f"{n_tokens} ids need another size")
        ids.extend(part)
        if k < n_ic:
            cache.ids.append(bytes(blobs[key]))
    max_id = getattr(tokenizer, "max_id", None)
    if ids and max_id is not None and max(ids) > max_id:
        raise ValueError(f"tokenizer state holds id {max(ids)} > the vocabulary's {max_id}")
    if verify and list(tokenizer.encode(text)) != ids.tolist():
        raise ValueError("tokenizer state ids differ from the reference on its text")
    stats: dict[str, int] = {}
    got = meta.get("stats", {})
    if isinstance(got, Mapping):
        stats = {k: v for k in STATS if type(v := got.get(k, 0)) is int and v >= 0}
    return Saved(text, ids, (base[0], base[1]), full, meta.get("shadow_rate", 0.01),
                 stats, cache)
