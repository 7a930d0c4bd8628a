"""Graph runner: static decode buffers, one CUDA graph per batch bucket, chunked eager prefill.

All decode inputs live in buffers allocated once and registered in the region registry; a
step copies the batch into them and replays the bucket's graph (CUDA) or calls the same
code eagerly over the same buffers (CPU). Nothing in `decode` allocates device memory on
the graph path, and nothing reads a device value back to the host except the sampler.
Sampling runs after the graph, on the logits, batched (`self.sampler`), with each stream's
own torch.Generator (host state of the stream, not a static buffer).
"""
from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..cudagraph import capture_graph
from ..state.regions import RegionRegistry
from .kv_pool import SCRATCH_BLOCK, BlockTable, KVPool, attended_blocks
from .model import Decoder
from .sampler import Sampler


class StepEngine(Protocol):
    """Runs one step with ``Decoder.forward``'s contract on the same pool, in place: K/V of the
    new tokens written to their slots, the final normed hidden states (B, T, D) returned."""
    name: str   # runtime.llm_engines name: "onnxruntime", ...
    # True: torch may capture a CUDA graph around a call (TensorRT's enqueue); False: the engine
    # does not allow it (ORT runs its own graph), so the runner replays no torch graph
    capturable: bool

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, kv_pool: torch.Tensor, *,
                 slot_valid: torch.Tensor | None = None, block_pos: torch.Tensor | None = None,
                 segments: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits (n, V) of hidden states (n, D): the model's LM head, or the engine's own
        graph of it (valid until the engine's next call)."""
        ...


@dataclass(frozen=True)
class DecodeRow:
    """One stream's next decode input: the token at `position`, written to `slot`."""

    token_id: int
    position: int
    slot: int
    blocks: Sequence[int]
    skip: tuple[int, int] = (0, 0)   # block indices holding nothing readable (BlockTable.skip)


class GraphRunner:
    """Owns the static buffers and the per-bucket graphs of one decoder + KV pool."""

    def __init__(self, model: Decoder, pool: KVPool, registry: RegionRegistry, *,
                 buckets: Sequence[int], max_context: int, prefill_chunk: int,
                 use_cuda_graphs: bool, step: StepEngine | None = None):
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"batch buckets must be strictly increasing ints >= 1, got {list(buckets)}")
        if max_context % pool.block_size:
            raise ValueError(f"max_context ({max_context}) must be a multiple of block_size "
                             f"({pool.block_size})")
        self.model, self.pool = model, pool
        # what runs a step: the model itself (torch) or an engine with its forward's contract
        self.step: StepEngine | Decoder = step if step is not None else model
        self.engine_name = "torch" if step is None else step.name
        self.head = model.lm_head if step is None else step.head     # (n, D) -> (n, V)
        capturable = step is None or step.capturable
        self.buckets = tuple(buckets)
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.max_blocks = max_context // pool.block_size
        dev = pool.tensor.device
        B, V = self.buckets[-1], model.cfg.vocab_size
        model.prepare_rope(max_context)
        self.input_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)               # (B, 1)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)               # (B, 1)
        self.slot_mapping = torch.zeros(B, dtype=torch.long, device=dev)               # (B,)
        self.block_tables = torch.full((B, self.max_blocks), SCRATCH_BLOCK, dtype=torch.long,
                                       device=dev)                                     # (B, nb)
        self.logits = torch.zeros(B, V, dtype=model.dtype, device=dev)                 # (B, V)
        # the sampler's scratch for up to B rows (not state: each stream's generator is)
        self.sampler = Sampler(B, V, dev)
        # host staging for one step's inputs, reused every step (not state: not registered): one
        # pinned block cut into a contiguous (B,) / (B, nb) part per static buffer, so each upload
        # is one cudaMemcpyAsync from pinned memory (a strided source, e.g. a column of a (B, 3+nb)
        # table, would first be copied into a pageable temporary on every step)
        pin = dev.type == "cuda"
        flat = torch.zeros(B * (3 + self.max_blocks), dtype=torch.long, pin_memory=pin)
        self._stage = (flat[:B], flat[B:2 * B], flat[2 * B:3 * B],
                       flat[3 * B:].view(B, self.max_blocks))      # token, position, slot, blocks
        self._stage_np = tuple(t.numpy() for t in self._stage)
        # marks when the last upload has read the staging (CUDA only): the next step waits for it
        # before rewriting the host rows, even if nobody read a device value back in between
        self._uploaded = torch.cuda.Event() if pin else None
        # the pool's page i is block i (one contiguous byte range); the checkpointer takes the
        # dirty set from the pool's write log instead of comparing pages
        registry.register("kv_pool", pool.tensor, "kv", page_bytes=pool.block_bytes)
        for name, buf, role in (("decode.input_ids", self.input_ids, "input"),
                                ("decode.positions", self.positions, "input"),
                                ("decode.slot_mapping", self.slot_mapping, "input"),
                                ("decode.block_tables", self.block_tables, "input"),
                                ("decode.logits", self.logits, "output")):
            registry.register(name, buf, role)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds: dict[int, float] = {}
        if use_cuda_graphs and capturable:
            self._capture_all()

    @property
    def uses_graphs(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, n: int) -> int:
        """Smallest bucket that holds n rows."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} streams exceeds the largest bucket {self.buckets[-1]}; "
                         f"decode at most {self.buckets[-1]} streams together")

    # -- decode ---------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """One decode step for len(rows) streams. Returns logits (n, V), a view of the static buffer."""
        n = len(rows)
        b = self.bucket_for(n)
        self._load_rows(rows, b)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            # eager: attend only over the blocks in use (same result, less work on CPU)
            longest = max(r.position for r in rows) + 1
            self._decode_body(b, -(-longest // self.pool.block_size), self._skipping_tables(rows, b))
        return self.logits[:n]

    def _skipping_tables(self, rows: Sequence[DecodeRow], b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eager decode only: (block tables, block indices) (b, width) without the rows' wholly
        empty memory-region blocks; None when no row leaves a block out. A graph always reads
        the full static table instead (its shapes are fixed)."""
        bs = self.pool.block_size
        kept = [attended_blocks(r.blocks, r.skip, -(-(r.position + 1) // bs)) for r in rows]
        if all(idx is None for _, idx in kept):
            return None
        width = max(len(blocks) for blocks, _ in kept)
        # padding: the scratch block at an index past max_context, so causality masks it
        tables = torch.full((b, width), SCRATCH_BLOCK, dtype=torch.long)
        index = torch.full((b, width), self.max_blocks, dtype=torch.long)
        for i, (blocks, idx) in enumerate(kept):
            tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            index[i, :len(blocks)] = torch.tensor(idx if idx is not None else range(len(blocks)),
                                                  dtype=torch.long)
        index[len(rows):, 0] = 0        # padded batch rows: token 0 at position 0 reads block 0
        dev = self.pool.tensor.device
        return tables.to(dev), index.to(dev)

    def _load_rows(self, rows: Sequence[DecodeRow], b: int) -> None:
        """Write the batch into the host staging rows, then one copy per static buffer.

        The staging is allocated once (pinned on CUDA): a step allocates nothing. It is reused
        only after the previous step's upload has read it (an event on CUDA).
        """
        tok, pos, slot, blk = self._stage_np
        if self._uploaded is not None:
            self._uploaded.synchronize()            # normally long done: logits were sampled since
        tok[:b], pos[:b], slot[:b] = 0, 0, SCRATCH_BLOCK * self.pool.block_size
        blk[:b] = SCRATCH_BLOCK
        for i, r in enumerate(rows):
            nb = len(r.blocks)
            if nb > self.max_blocks:
                raise ValueError(f"stream needs {nb} blocks, max_context allows {self.max_blocks}")
            tok[i], pos[i], slot[i] = r.token_id, r.position, r.slot
            blk[i, :nb] = r.blocks
        s_tok, s_pos, s_slot, s_blk = self._stage
        # copy_ into the static buffers: their storage (and the graphs' addresses) never change;
        # every source and destination here is contiguous, so each is one async copy
        self.input_ids[:b, 0].copy_(s_tok[:b], non_blocking=True)
        self.positions[:b, 0].copy_(s_pos[:b], non_blocking=True)
        self.slot_mapping[:b].copy_(s_slot[:b], non_blocking=True)
        self.block_tables[:b].copy_(s_blk[:b], non_blocking=True)
        if self._uploaded is not None:
            # on the stream the copies went to (the destination device's current stream)
            self._uploaded.record(torch.cuda.current_stream(self.input_ids.device))

    def _decode_body(self, b: int, n_blocks: int | None = None,
                     skipping: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        nb = self.max_blocks if n_blocks is None else n_blocks
        tables, block_pos = (self.block_tables[:b, :nb], None) if skipping is None else skipping
        hidden = self.step(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b],
                            tables, self.pool.tensor, slot_valid=self.pool.slot_valid,
                            block_pos=block_pos)                                 # (b, 1, D)
        self.logits[:b].copy_(self.head(hidden[:, -1]))

    def _capture_all(self) -> None:
        # largest bucket first so the smaller graphs fit inside its memory pool (one side stream
        # for all of them, as torch asks of captures sharing a pool)
        dev = self.pool.tensor.device          # streams and graphs on the pool's GPU
        mem_pool, side = None, torch.cuda.Stream(dev)
        for b in sorted(self.buckets, reverse=True):
            t0 = time.perf_counter()
            graph = capture_graph(functools.partial(self._decode_body, b), dev, pool=mem_pool, stream=side)
            mem_pool = graph.pool()
            self.graphs[b] = graph
            self.capture_seconds[b] = time.perf_counter() - t0

    # -- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], table: BlockTable) -> torch.Tensor:
        """Write K/V for `token_ids` at tokens table.num_cached.. and return the last logits (V,).

        Chunked and eager: prompts vary in length, so they are not worth a graph each.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        start = table.num_cached
        end = start + len(token_ids)
        if table.slot_end(end) > self.max_context:
            raise ValueError(f"stream would span {table.slot_end(end)} positions; max_context is "
                             f"{self.max_context}")
        table.ensure_capacity(end)
        dev = self.pool.tensor.device
        hidden = None
        for c0 in range(start, end, self.prefill_chunk):
            c1 = min(c0 + self.prefill_chunk, end)
            ids = torch.tensor(token_ids[c0 - start:c1 - start], dtype=torch.long, device=dev)
            at = table.positions(c0, c1)
            pos = torch.tensor(at, dtype=torch.long, device=dev)
            slots = torch.tensor(table.slots_at(at), dtype=torch.long, device=dev)
            nb = -(-(at[-1] + 1) // self.pool.block_size)
            kept, idx = table.attended(nb)   # wholly empty memory-region blocks are left out
            blocks = torch.tensor(kept, dtype=torch.long, device=dev)
            block_pos = None if idx is None else torch.tensor([idx], dtype=torch.long, device=dev)
            hidden = self.step(ids.view(1, -1), pos.view(1, -1), slots, blocks.view(1, -1),
                                self.pool.tensor, slot_valid=self.pool.slot_valid,
                                block_pos=block_pos,
                                segments=_gap_segments(at, idx, self.pool.block_size))  # (1, C, D)
            table.num_cached = c1
        if self.step is self.model:
            return self.model.lm_head(hidden[0, -1])
        # an engine's head takes (n, D) rows and may keep one buffer per n: the copy outlives
        # it (generate stacks several streams' prefills)
        return self.head(hidden[0, -1:])[0].clone()


def _gap_segments(at: list[int], kept_idx: list[int] | None,
                  block_size: int) -> tuple[tuple[int, int, int], ...] | None:
    """Query segments for a prefill chunk whose positions jump over a memory region: the
    queries before the jump read only the kept blocks up to their last position (the region
    and everything after it are masked for them), the rest read every kept block."""
    split = next((t for t in range(1, len(at)) if at[t] != at[t - 1] + 1), None)
    if split is None:
        return None
    last_block = at[split - 1] // block_size
    n_blocks = last_block + 1 if kept_idx is None else bisect.bisect_right(kept_idx, last_block)
    n_all = len(kept_idx) if kept_idx is not None else -(-(at[-1] + 1) // block_size)
    return ((0, split, n_blocks * block_size), (split, len(at), n_all * block_size))
