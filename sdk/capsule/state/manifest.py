"""A Session capsule's manifest: JSON with the binding, the host state and the blob sizes.

Written by `encode`, read back by `parse` as untrusted bytes: bounded strict JSON (safejson),
then every field's type and range checked against `Limits` (what this Session could ever
hold) before anything is allocated for it. Anything off raises EpochCorrupt naming the epoch
and the field. The deeper checks (ids in the vocabulary, blocks inside the pool) are the
stream importer's, against the live engine (docs/FORMAT.md, "What a Session capsule holds").
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .. import safejson
from ..errors import CapsuleCorrupt
from . import fields
from .binding import Binding

# a real one is ~6 KB (builtin:small, 8 streams of 2K tokens, a small app state): ~170x headroom.
# checkpoint refuses to write a bigger one, so every manifest written can be read back
MAX_MANIFEST_BYTES = 1 << 20
MAX_STREAMS = 1024
MAX_NAME_CHARS = 1024
# text per position: generous (a token is a few bytes; a long whitespace token ~100)
TEXT_BYTES_PER_POSITION = 1024
MIN_TEXT_BYTES = 1 << 20
MAX_RNG_BYTES = 1 << 16
MAX_TOK_BLOBS = 8           # per stream: the incremental tokenizer writes 3
_STREAM_KINDS = ("ids", "blocks", "text", "user", "tail", "rng")


class EpochCorrupt(CapsuleCorrupt):
    """A checksum-valid epoch whose content cannot be restored (bad manifest or pages)."""

    def __init__(self, epoch: int, detail: str):
        super().__init__(f"epoch {epoch}: {detail}; nothing was restored from it: restore another epoch "
                         f"(see Session.epochs()) and keep a copy of the store folder for `capsule verify`")
        self.epoch = epoch
        self.detail = detail    # without the epoch: the store's skip report adds it


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
        return {"ids": 4 * self.max_context, "blocks": 4 * self.max_blocks, "text": text, "user": text,
                "tail": 3, "rng": MAX_RNG_BYTES}.get(kind, max(text, 16 * (self.max_context + 1)))


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
        most = limits.blob_bytes(key.split("/", 1)[0])
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
        streams = _streams(host.get("streams"), limits)
        fields.obj(host.get("app_state"), "host.app_state")
        policy = fields.optional(host.get("policy"), "host.policy", dict)
        if policy is not None:
            for k in ("queued", "served"):
                fields.integer(policy.get(k), f"host.policy.{k}", 0, 1 << 31)
        sizes = _blob_sizes(doc["blobs"], {s["name"] for s in streams}, limits)
    except fields.FieldError as exc:
        raise EpochCorrupt(epoch, f"manifest field {exc}") from None
    except ValueError as exc:   # safejson: too big, not JSON, NaN, too deep
        raise EpochCorrupt(epoch, str(exc)) from None
    return Manifest(epoch, binding, host, sizes)


def _streams(value: object, limits: Limits) -> list[dict]:
    most = MAX_STREAMS if limits.max_context != 0 else 0   # a session without a model has none
    streams = fields.seq(value, "host.streams", most)
    hi = limits.max_context if limits.max_context is not None else 1 << 31
    names: set[str] = set()
    for i, m in enumerate(streams):
        at = f"host.streams[{i}]"
        m = fields.obj(m, at)
        name = fields.text(m.get("name"), f"{at}.name", MAX_NAME_CHARS)
        if name in names:
            raise fields.FieldError(f"{at}.name", f"{name!r} appears twice")
        names.add(name)
        n_ids = fields.integer(m.get("n_ids"), f"{at}.n_ids", 0, hi)
        fields.integer(m.get("num_cached"), f"{at}.num_cached", 0, n_ids)
        for key in ("pending_chars", "system_chars"):
            if key in m:
                fields.integer(m[key], f"{at}.{key}", 0, 1 << 40)
        fields.optional(m.get("generator_device"), f"{at}.generator_device", str)
        fields.optional(m.get("tokenizer"), f"{at}.tokenizer", dict)
        fields.optional(m.get("region"), f"{at}.region", dict)
    return streams


def _blob_sizes(value: object, names: set[str], limits: Limits) -> dict[str, int]:
    sizes = fields.obj(value, "blobs")
    if len(sizes) > len(names) * (len(_STREAM_KINDS) + MAX_TOK_BLOBS):
        raise fields.FieldError("blobs", f"lists {len(sizes)} blobs for {len(names)} streams")
    tok_count: dict[str, int] = {}
    for key, size in sizes.items():
        kind, _, rest = key.partition("/")
        name = rest.rpartition("/")[0] if kind == "tok" else rest
        if kind not in (*_STREAM_KINDS, "tok") or name not in names:
            raise fields.FieldError(f"blobs[{key[:60]!r}]", "names no stream of this capsule")
        if kind == "tok":
            tok_count[name] = tok_count.get(name, 0) + 1
            if tok_count[name] > MAX_TOK_BLOBS:
                raise fields.FieldError("blobs", f"stream {name!r} has over {MAX_TOK_BLOBS} tokenizer blobs")
        fields.integer(size, f"blobs[{key[:60]!r}]", 0, limits.blob_bytes(kind))
    return dict(sizes)
