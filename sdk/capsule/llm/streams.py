"""Streams and their execution state: what a capsule carries for the engine besides KV blocks.

Saved state is untrusted on restore: every count, id and block is range-checked before the
session is touched, and anything off raises ValueError (the checkpointer reports CapsuleCorrupt).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ..tokenize import IncrementalTokenizer
from .kv_pool import BlockTable, KVPool
from .region import Region, mark_holes

if TYPE_CHECKING:
    from .engine import Engine

MAX_STREAM_NAME_BYTES = 200  # names become part of record names in the store


@dataclass
class Stream:
    """Host state of one stream."""

    name: str
    table: BlockTable
    text: str = ""
    ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # the exact incremental tokenizer over text[:len(text) - len(pending)]; generated text waits
    # in `pending` until the next append. A restored stream keeps the saved tokenizer state in
    # `tok_state` and rebuilds it on its first append (a restore needs no encoder)
    tok: IncrementalTokenizer | None = None
    tok_state: tuple[dict, dict[str, bytes]] | None = None
    pending: str = ""
    # text[:system_chars] is the system prefix; a memory region (facts' K/V) sits right after it
    system_chars: int = 0
    region: Region | None = None
    # the user's turn: (non-system) text appended since the model last spoke, the query that
    # picks the memory facts (Engine.append)
    last_user: str = ""

    @classmethod
    def new(cls, name: str, pool: KVPool) -> "Stream":
        return cls(name, BlockTable(pool))


def check_stream_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"stream name must be a non-empty str, got {name!r}")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        # it would be accepted here and then fail every checkpoint (names are saved as UTF-8)
        raise ValueError(f"stream name {name!r} is not valid Unicode text (an unpaired surrogate)") from None
    if size > MAX_STREAM_NAME_BYTES:
        raise ValueError(f"stream name is longer than {MAX_STREAM_NAME_BYTES} bytes; use a shorter one")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"stream name {name!r} holds a control character; use printable text")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def export_streams(engine: "Engine") -> tuple[list[dict], dict[str, bytes]]:
    """Stream metadata (small, JSON) and the per-stream blobs (ids, text, blocks, RNG state)."""
    meta, blobs = [], {}
    for s in engine.streams.values():
        gen = s.generator
        tok_meta, tok_blobs = s.tok.state_dict() if s.tok is not None else (s.tok_state or (None, {}))
        meta.append({"name": s.name, "num_cached": s.table.num_cached, "n_ids": len(s.ids),
                     "generator_device": None if gen is None else str(gen.device),
                     "pending_chars": len(s.pending), "tokenizer": tok_meta,
                     "system_chars": s.system_chars,
                     "region": s.region.to_json() if s.region is not None else None})
        for key, blob in tok_blobs.items():
            blobs[f"tok/{s.name}/{key}"] = blob
        blobs[f"ids/{s.name}"] = np.asarray(s.ids, dtype="<i4").tobytes()
        blobs[f"blocks/{s.name}"] = np.asarray(s.table.blocks, dtype="<i4").tobytes()
        blobs[f"text/{s.name}"] = s.text.encode("utf-8", "surrogatepass")
        blobs[f"user/{s.name}"] = s.last_user.encode("utf-8", "surrogatepass")
        if gen is not None:
            blobs[f"rng/{s.name}"] = gen.get_state().numpy().tobytes()
    return meta, blobs


def _int_field(m: dict, key: str, lo: int, hi: int) -> int:
    v = m.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{key}={v!r} is not an int in {lo}..{hi}")
    return v


def _i4(blob: bytes, what: str) -> np.ndarray:
    if len(blob) % 4:
        raise ValueError(f"{what} is {len(blob)} bytes, not a whole number of int32s")
    return np.frombuffer(blob, dtype="<i4")


def import_streams(engine: "Engine", meta: list, blobs: dict[str, bytes]) -> Callable[[], None]:
    """Parse saved streams, changing nothing, and return the step that installs them and
    rebuilds the pool's free list to match. Raises ValueError/KeyError on anything off."""
    if not isinstance(meta, list):
        raise ValueError("streams must be a list")
    pool, runner = engine.pool, engine.runner
    vocab, device = runner.model.cfg.vocab_size, pool.tensor.device
    streams: dict[str, Stream] = {}
    used: set[int] = set()
    for m in meta:
        name = m["name"]
        check_stream_name(name)
        if name in streams:
            raise ValueError(f"stream {name!r} appears twice")
        n_ids = _int_field(m, "n_ids", 0, runner.max_context)
        num_cached = _int_field(m, "num_cached", 0, n_ids)
        ids = _i4(blobs[f"ids/{name}"], "ids")
        blocks = _i4(blobs[f"blocks/{name}"], "block table")
        if len(ids) != n_ids or (len(ids) and (ids.min() < 0 or ids.max() >= vocab)):
            raise ValueError(f"stream {name!r}: saved ids do not fit the model's {vocab} ids")
        region = None
        if m.get("region") is not None:
            region = Region.from_json(m["region"], pool.block_size, runner.max_context)
        table = BlockTable(pool)
        if region is not None:
            table.gap_at, table.gap = region.gap_at, region.start + region.size - region.gap_at
            table.pinned = (region.start + region.size) // pool.block_size
        need = max(-(-table.slot_end(num_cached) // pool.block_size), table.pinned)
        if len(blocks) > runner.max_blocks or len(blocks) < need:
            raise ValueError(f"stream {name!r}: block table does not cover its {num_cached} cached tokens")
        if len(blocks) and (blocks.min() < 1 or blocks.max() >= pool.num_blocks) or \
                len(set(blocks.tolist())) != len(blocks) or used & set(blocks.tolist()):
            raise ValueError(f"stream {name!r}: saved block table is outside the pool or shared")
        table.blocks, table.num_cached = blocks.tolist(), num_cached
        used.update(table.blocks)
        text = blobs[f"text/{name}"].decode("utf-8", "surrogatepass")
        pending = _int_field(m, "pending_chars", 0, len(text)) if "pending_chars" in m else 0
        system_chars = _int_field(m, "system_chars", 0, len(text)) if "system_chars" in m else 0
        streams[name] = Stream(name, table, text, ids.tolist(),
                               _generator(m.get("generator_device"), blobs.get(f"rng/{name}"), device),
                               tok_state=_tok_state(name, m.get("tokenizer"), blobs),
                               pending=text[len(text) - pending:] if pending else "",
                               system_chars=system_chars, region=region,
                               last_user=blobs.get(f"user/{name}", b"").decode("utf-8", "surrogatepass"))

    def install() -> None:
        engine.streams = streams
        pool.reset_allocation(used)
        pool.slot_valid.fill_(True)   # derived state: holes come from the streams' regions
        for st in streams.values():
            if st.region is not None:
                mark_holes(st.table, st.region)
    return install


def _tok_state(name: str, meta: object, blobs: dict[str, bytes]) -> tuple[dict, dict[str, bytes]] | None:
    # checked in depth when the tokenizer is rebuilt on the first append; a bad state then
    # falls back to one full encode, so it can cost time but never exactness
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise ValueError(f"stream {name!r}: tokenizer state is not an object")
    prefix = f"tok/{name}/"
    return meta, {k[len(prefix):]: v for k, v in blobs.items() if k.startswith(prefix)}


def _generator(saved_device: object, state: bytes | None, device: torch.device) -> torch.Generator | None:
    if saved_device is None:
        return None
    if saved_device not in ("cpu", str(device)) or state is None:
        raise ValueError(f"generator device {saved_device!r} is not this session's ({device})")
    gen = torch.Generator(device=saved_device)
    if len(state) != gen.get_state().numel():
        raise ValueError(f"generator state is {len(state)} bytes, expected {gen.get_state().numel()}")
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen
