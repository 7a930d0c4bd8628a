"""A Session capsule's manifest: JSON with the binding, the host state and the blob sizes.

Written by `encode`, read back by `parse` as untrusted bytes: bounded strict JSON (safejson),
then every field's type and range checked against `Limits` (what this Session could ever
hold) before anything is allocated for it, and the blobs against the layout the streams claim
(each stream's text and ids as fixed-size chunks plus the rest, tokenize/incremental_state).
Anything off raises EpochCorrupt naming the epoch and the field; a host state of another
format, UnsupportedHostFormat. The deeper checks (ids in the vocabulary, blocks inside the
pool) are the stream importer's, against the live engine (docs/FORMAT.md, "What a Session
capsule holds").
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .. import safejson
from ..errors import CapsuleCorrupt
from ..tokenize.incremental_state import CHUNK_CHARS, CHUNK_IDS
from . import fields
from .binding import Binding

# 2: each stream's text and ids once, as its tokenizer's chunks (format 1, without a
# "format" field: whole ids/text blobs per stream and again inside the tokenizer's state)
HOST_FORMAT = 2

# a real one is ~6 KB (builtin:small, 8 streams of 2K tokens, a small app state): ~170x headroom.
# checkpoint refuses to write a bigger one, so every manifest written can be read back
MAX_MANIFEST_BYTES = 1 << 20
MAX_STREAMS = 1024
MAX_NAME_CHARS = 1024
# text per position: generous (a token is a few bytes; a long whitespace token ~100)
TEXT_BYTES_PER_POSITION = 1024
MIN_TEXT_BYTES = 1 << 20
MAX_RNG_BYTES = 1 << 16
# per stream, besides the chunks "ids.<k>" and "text.<k>" (complete chunks of its text and ids)
_STREAM_KINDS = ("ids", "text", "gen", "pending", "blocks", "user", "tail", "rng")
_REQUIRED = ("ids", "text", "blocks")


class EpochCorrupt(CapsuleCorrupt):
    """A checksum-valid epoch whose content cannot be restored (bad manifest or pages)."""

    def __init__(self, epoch: int, detail: str):
        super().__init__(f"epoch {epoch}: {detail}; nothing was restored from it: restore another epoch "
                         f"(see Session.epochs()) and keep a copy of the store folder for `capsule verify`")
        self.epoch = epoch
        self.detail = detail    # without the epoch: the store's skip report adds it


class UnsupportedHostFormat(EpochCorrupt):
    """An epoch whose host state another SDK version wrote: nothing is read from it."""

    def __init__(self, epoch: int, found: object):
        what = "1 (no 'format' field)" if found is None else repr(found)[:20]
        super().__init__(epoch, f"host state format {what} is not this SDK's format {HOST_FORMAT}: "
                                "the capsule was written by another SDK version (format 1: before "
                                "streams were written as chunks); restore it with that version, or "
                                "open with restore=False to start fresh")


@dataclass(frozen=True)
class Limits:
    """What this Session could ever hold; a manifest claiming more is refused before allocating."""

    max_context: int | None = None      # positions per stream; None: unknown (inspect), 0: no model
    max_blocks: int = 0                 # KV blocks in one stream's table
    max_manifest_bytes: int = MAX_MANIFEST_BYTES

    def blob_bytes(self, kind: str) -> int:
        """The most bytes a host blob of this kind ("ids", "tok", ...) can take."""
        if self.max_context is None:
            return 1 << 40
        text = max(MIN_TEXT_BYTES, TEXT_BYTES_PER_POSITION * self.max_context)
        return {"ids": 4 * self.max_context, "gen": 4 * self.max_context, "blocks": 4 * self.max_blocks,
                "text": text, "pending": text, "user": text, "tail": 3,
                "rng": MAX_RNG_BYTES}.get(kind, max(text, 16 * (self.max_context + 1)))


@dataclass(frozen=True)
class Manifest:
    epoch: int
    binding: Binding
    host: dict                  # {"streams": [...], "app_state": {...}, "policy": {...}?}
    blob_sizes: dict[str, int]


def encode(binding: Binding, host: dict, blob_sizes: dict[str, int], limits: Limits) -> bytes:
    """The manifest's bytes; ValueError (nothing written) if it could not be read back."""
    if len(host.get("streams", [])) > MAX_STREAMS:
        raise ValueError(f"a capsule holds at most {MAX_STREAMS} streams; drop some (Session.drop_stream)")
    for key, size in blob_sizes.items():
        most = limits.blob_bytes(key.split("/", 1)[0].partition(".")[0])
        if size > most:
            raise ValueError(f"host state {key!r} is {size} bytes; a capsule holds at most {most}")
    data = json.dumps({"binding": binding.to_dict(), "host": host, "blobs": blob_sizes},
                      separators=(",", ":"), allow_nan=False).encode()
    if len(data) > limits.max_manifest_bytes:
        app = len(json.dumps(host.get("app_state"), separators=(",", ":")))
        raise ValueError(f"the capsule manifest would be {len(data)} bytes (Session.state takes {app}); at "
                         f"most {limits.max_manifest_bytes}: keep Session.state small (large data belongs "
                         "in files of its own) or use fewer streams")
    return data


def parse(epoch: int, data: bytes, limits: Limits) -> Manifest:
    """Check a manifest read from disk; EpochCorrupt naming the epoch and the field if it is off."""
    try:
        doc = safejson.loads(data, what="manifest", max_bytes=limits.max_manifest_bytes)
        doc = fields.obj(doc, "manifest")
        for key in ("binding", "host", "blobs"):
            if key not in doc:
                raise fields.FieldError("manifest", f"has no {key!r}")
        binding = Binding.from_dict(doc["binding"])
        host = fields.obj(doc["host"], "host")
        if host.get("format") != HOST_FORMAT:
            raise UnsupportedHostFormat(epoch, host.get("format"))
        streams = _streams(host.get("streams"), limits)
        fields.obj(host.get("app_state"), "host.app_state")
        policy = fields.optional(host.get("policy"), "host.policy", dict)
        if policy is not None:
            for k in ("queued", "served"):
                fields.integer(policy.get(k), f"host.policy.{k}", 0, 1 << 31)
        sizes = _blob_sizes(doc["blobs"], streams, limits)
    except fields.FieldError as exc:
        raise EpochCorrupt(epoch, f"manifest field {exc}") from None
    except ValueError as exc:   # safejson: too big, not JSON, NaN, too deep
        raise EpochCorrupt(epoch, str(exc)) from None
    return Manifest(epoch, binding, host, sizes)


@dataclass(frozen=True)
class _Layout:
    """What a stream entry says its blobs hold."""
    tokens: int         # canonical ids (its tokenizer's)
    chars: int          # canonical text
    generated: int      # ids generated after them


def _streams(value: object, limits: Limits) -> dict[str, _Layout]:
    most = MAX_STREAMS if limits.max_context != 0 else 0   # a session without a model has none
    streams = fields.seq(value, "host.streams", most)
    hi = limits.max_context if limits.max_context is not None else 1 << 31
    out: dict[str, _Layout] = {}
    for i, m in enumerate(streams):
        at = f"host.streams[{i}]"
        m = fields.obj(m, at)
        name = fields.text(m.get("name"), f"{at}.name", MAX_NAME_CHARS)
        if name in out:
            raise fields.FieldError(f"{at}.name", f"{name!r} appears twice")
        n_ids = fields.integer(m.get("n_ids"), f"{at}.n_ids", 0, hi)
        fields.integer(m.get("num_cached"), f"{at}.num_cached", 0, n_ids)
        generated = fields.integer(m.get("generated"), f"{at}.generated", 0, n_ids)
        fields.integer(m.get("system_chars"), f"{at}.system_chars", 0, 1 << 40)
        fields.optional(m.get("generator_device"), f"{at}.generator_device", str)
        fields.optional(m.get("region"), f"{at}.region", dict)
        tok = fields.obj(m.get("tokenizer"), f"{at}.tokenizer")
        tokens = fields.integer(tok.get("tokens"), f"{at}.tokenizer.tokens", 0, n_ids)
        if tokens != n_ids - generated:
            raise fields.FieldError(f"{at}.tokenizer.tokens", f"is {tokens}; the entry's n_ids "
                                    f"{n_ids} less its {generated} generated ids is {n_ids - generated}")
        chars = fields.integer(tok.get("chars"), f"{at}.tokenizer.chars", 0, limits.blob_bytes("text"))
        out[name] = _Layout(tokens, chars, generated)
    return out


def _blob_sizes(value: object, streams: dict[str, _Layout], limits: Limits) -> dict[str, int]:
    """Every blob names a stream and a kind its layout holds, at the size that layout gives;
    each stream has its text and ids chunks, no more, and its required blobs."""
    sizes = fields.obj(value, "blobs")
    most = sum(len(_STREAM_KINDS) + t.tokens // CHUNK_IDS + t.chars // CHUNK_CHARS for t in streams.values())
    if len(sizes) > most:
        raise fields.FieldError("blobs", f"lists {len(sizes)} blobs for {len(streams)} streams")
    chunks: dict[tuple[str, str], int] = {}
    for key, size in sizes.items():
        at = f"blobs[{key[:60]!r}]"
        kind, _, name = key.partition("/")
        base, dot, index = kind.partition(".")
        lay = streams.get(name)
        if lay is None or (base not in _STREAM_KINDS if not dot else base not in ("ids", "text")):
            raise fields.FieldError(at, "names no stream of this capsule")
        fields.integer(size, at, 0, limits.blob_bytes(base))
        if dot:
            n = lay.tokens // CHUNK_IDS if base == "ids" else lay.chars // CHUNK_CHARS
            if not (index.isdigit() and index == str(int(index)) and int(index) < n):
                raise fields.FieldError(at, f"is no chunk of the stream's {n} complete {base} chunks")
            chunks[(name, base)] = chunks.get((name, base), 0) + 1
        lo, hi = _size_range(base, bool(dot), lay)
        if not lo <= size <= hi:
            want = f"{lo}" if lo == hi else f"{lo}..{hi}"
            raise fields.FieldError(at, f"is {size} bytes; the stream's entry makes it {want} bytes")
    for name, lay in streams.items():
        for kind in _REQUIRED + (("gen",) if lay.generated else ()):
            if f"{kind}/{name}" not in sizes:
                raise fields.FieldError("blobs", f"has no {kind!r} blob for stream {name!r}")
        for base, n in (("ids", lay.tokens // CHUNK_IDS), ("text", lay.chars // CHUNK_CHARS)):
            if chunks.get((name, base), 0) != n:
                raise fields.FieldError("blobs", f"stream {name!r} has {chunks.get((name, base), 0)} "
                                                 f"{base} chunks; its entry needs {n}")
    return dict(sizes)


def _size_range(base: str, chunk: bool, lay: _Layout) -> tuple[int, int]:
    """(least, most) bytes of a blob of this kind; (0, big) where the layout does not fix it."""
    if base == "ids":
        n = CHUNK_IDS if chunk else lay.tokens % CHUNK_IDS
        return 4 * n, 4 * n
    if base == "text":               # UTF-8: 1 to 4 bytes a char (a lone surrogate takes 3)
        n = CHUNK_CHARS if chunk else lay.chars % CHUNK_CHARS
        return n, 4 * n
    if base == "gen":
        return 4 * lay.generated, 4 * lay.generated
    return 0, 1 << 62
