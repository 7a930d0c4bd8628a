"""Engine: streams of tokens over one decoder, prefilled on demand and decoded together.

A stream's token ids are the reference tokenizer's ids of its text, followed by whatever
the model generated since the last append. K/V is cached for ids[:table.num_cached].
Not thread-safe: the Session serializes calls.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..tokenize import ReferenceTokenizer
from .kv_pool import BlockTable, KVPool
from .runner import DecodeRow, GraphRunner
from .sampler import SamplingParams, make_generator, sample_rows


@dataclass
class Stream:
    """Host state of one stream (what a capsule must carry besides the KV blocks)."""

    name: str
    table: BlockTable
    text: str = ""
    ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """Append text, generate tokens; owns the streams, shares the pool and runner."""

    def __init__(self, runner: GraphRunner, pool: KVPool, tokenizer: ReferenceTokenizer):
        self.runner, self.pool, self.tokenizer = runner, pool, tokenizer
        self.streams: dict[str, Stream] = {}

    def stream(self, name: str, *, create: bool = False) -> Stream:
        if not isinstance(name, str) or not name:
            raise ValueError(f"stream name must be a non-empty str, got {name!r}")
        if name not in self.streams:
            if not create:
                raise KeyError(f"no stream {name!r}; streams: {', '.join(self.streams) or 'none yet'} "
                               "(append text to create one)")
            self.streams[name] = Stream(name, BlockTable(self.pool))
        return self.streams[name]

    def append(self, name: str, text: str) -> None:
        """Add text; re-tokenize the whole text and keep the K/V of the unchanged id prefix."""
        if not isinstance(text, str):
            raise ValueError(f"append takes str, got {type(text).__name__}")
        s = self.stream(name, create=True)
        new_text = s.text + text
        ids = self.tokenizer.encode(new_text)
        if len(ids) > self.runner.max_context:
            raise ValueError(f"stream {name!r} would hold {len(ids)} tokens; max_context is "
                             f"{self.runner.max_context} (raise runtime.max_context)")
        keep = common_prefix(s.ids, ids)
        s.table.truncate(keep)  # a re-tokenized seam invalidates the K/V after it
        s.text, s.ids = new_text, ids

    def generate(self, names: Sequence[str], max_new_tokens: int, params: SamplingParams,
                 seed: int | None, stop: Sequence[str]) -> dict[str, str]:
        """Generate up to max_new_tokens for each stream, decoding all of them in one batch per step."""
        streams = [self.stream(n) for n in names]
        for s in streams:
            if not s.ids:
                raise ValueError(f"stream {s.name!r} is empty; append text before generating")
            if len(s.ids) + max_new_tokens > self.runner.max_context:
                raise ValueError(f"stream {s.name!r} holds {len(s.ids)} tokens; {max_new_tokens} more "
                                 f"exceed max_context {self.runner.max_context}")
            self._prepare_generator(s, params, seed)
        out = {s.name: bytearray() for s in streams}
        stops = [x.encode() for x in stop]
        eos = set(self.tokenizer.eos_ids)
        logits = torch.stack([self._prefill_pending(s) for s in streams])          # (n, V)
        active = list(streams)
        for step in range(max_new_tokens):
            picks = sample_rows(logits, [params] * len(active), [s.generator for s in active])
            still = []
            for s, tok in zip(active, picks):
                s.ids.append(tok)
                out[s.name] += self.tokenizer.decode_bytes([tok])
                done = tok in eos or any(x in out[s.name] for x in stops)
                if not done and step + 1 < max_new_tokens:
                    still.append(s)
            active = still
            if not active:
                break
            logits = self.runner.decode([self._next_row(s) for s in active])
        replies = {}
        for s in streams:
            full = out[s.name].decode("utf-8", errors="replace")
            s.text += full
            replies[s.name] = _cut_at_stop(full, stop, self.tokenizer, s.ids[-1] in eos)
        return replies

    def _prepare_generator(self, s: Stream, params: SamplingParams, seed: int | None) -> None:
        if seed is not None:
            s.generator = make_generator(seed, self.pool.tensor.device)
        elif s.generator is None and not params.greedy:
            # unseeded sampling still gets an explicit generator: its state is execution state
            s.generator = make_generator(int.from_bytes(os.urandom(8), "little") >> 1,
                                         self.pool.tensor.device)

    def _prefill_pending(self, s: Stream) -> torch.Tensor:
        """Logits after the stream's last token, computing K/V for the uncached ids."""
        if s.table.num_cached >= len(s.ids):
            s.table.truncate(len(s.ids) - 1)  # recompute the last token to get its logits
        return self.runner.prefill(s.ids[s.table.num_cached:], s.table)

    def _next_row(self, s: Stream) -> DecodeRow:
        pos = len(s.ids) - 1
        s.table.ensure_capacity(pos + 1)
        row = DecodeRow(s.ids[-1], pos, s.table.slots(pos, pos + 1)[0], tuple(s.table.blocks))
        s.table.num_cached = pos + 1
        return row


def _cut_at_stop(text: str, stop: Sequence[str], tokenizer: ReferenceTokenizer, ended_on_eos: bool) -> str:
    """The reply as returned to the caller: without the stop string or the end-of-sequence token."""
    cut = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if ended_on_eos:
        for eos_id in tokenizer.eos_ids:
            tail = tokenizer.decode_bytes([eos_id]).decode("utf-8", errors="replace")
            if text.endswith(tail):
                return text[: len(text) - len(tail)]
    return text


# -- execution state (what a capsule carries for the engine) ------------------------------------
def export_streams(engine: Engine) -> tuple[list[dict], dict[str, bytes]]:
    """Stream metadata (small, JSON) and the per-stream blobs (ids, text, blocks, RNG state)."""
    meta, blobs = [], {}
    for s in engine.streams.values():
        gen = s.generator
        meta.append({"name": s.name, "num_cached": s.table.num_cached, "n_ids": len(s.ids),
                     "generator_device": None if gen is None else str(gen.device)})
        blobs[f"ids/{s.name}"] = np.asarray(s.ids, dtype="<i4").tobytes()
        blobs[f"blocks/{s.name}"] = np.asarray(s.table.blocks, dtype="<i4").tobytes()
        blobs[f"text/{s.name}"] = s.text.encode("utf-8", "surrogatepass")
        if gen is not None:
            blobs[f"rng/{s.name}"] = gen.get_state().numpy().tobytes()
    return meta, blobs


def import_streams(engine: Engine, meta: list[dict], blobs: dict[str, bytes]) -> Callable[[], None]:
    """Parse saved streams (raising ValueError on anything inconsistent, changing nothing) and
    return the step that installs them and rebuilds the pool's free list to match."""
    streams: dict[str, Stream] = {}
    used: set[int] = set()
    for m in meta:
        name = m["name"]
        table = BlockTable(engine.pool)
        table.blocks = np.frombuffer(blobs[f"blocks/{name}"], dtype="<i4").tolist()
        table.num_cached = int(m["num_cached"])
        ids = np.frombuffer(blobs[f"ids/{name}"], dtype="<i4").tolist()
        if len(ids) != m["n_ids"] or table.num_cached > len(ids) or \
                len(table.blocks) * engine.pool.block_size < table.num_cached:
            raise ValueError(f"stream {name!r}: saved ids, blocks and cache length disagree")
        if any(not 0 < b < engine.pool.num_blocks for b in table.blocks) or used & set(table.blocks):
            raise ValueError(f"stream {name!r}: saved block table is outside the pool or shared")
        used.update(table.blocks)
        gen = None
        if m.get("generator_device") is not None:
            gen = torch.Generator(device=m["generator_device"])
            gen.set_state(torch.frombuffer(bytearray(blobs[f"rng/{name}"]), dtype=torch.uint8))
        text = blobs[f"text/{name}"].decode("utf-8", "surrogatepass")
        streams[name] = Stream(name, table, text, ids, gen)

    def install() -> None:
        engine.streams = streams
        engine.pool.reset_allocation(used)
    return install
