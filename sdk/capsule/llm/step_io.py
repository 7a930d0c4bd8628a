"""Static I/O buffers of one engine step shape, and the bucketing that keeps the shapes few.

An engine (ONNX Runtime, TensorRT) binds a shape's buffers once: their addresses never change,
so a binding is made once per shape and a captured CUDA graph (ORT's, or torch's around a
TensorRT enqueue) replays over them. A call copies its inputs into the buffers and pads them up
to the shape: T is rounded up to a power of two and the block-table width to one of four
widths per power of two (``table_bucket``), padding tokens
write to slots of the scratch block and are never attended, padding blocks are the scratch
block and lie past every query's position. Nothing here reads a device value back to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .kv_pool import SCRATCH_BLOCK
from .onnx_step import StepShape, step_bias


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def table_bucket(nb: int) -> int:
    """nb rounded up to one of four widths per power of two (1..8, 10, 12, 14, 16, 20, ...):
    attention cost follows the width, so at most 25 % of it is padding (a power of two made a
    decode at 33 blocks attend 64), for about four sessions per doubling of the context."""
    step = max(1, pow2(nb) // 8)
    return -(-nb // step) * step


def bucket_shape(input_ids: torch.Tensor, block_tables: torch.Tensor, kv_pool: torch.Tensor) -> StepShape:
    """The step shape a call of (B, T) tokens over (B, nb) block tables runs as."""
    B, T = input_ids.shape
    return StepShape(B, pow2(T), table_bucket(block_tables.shape[1]), kv_pool.shape[0], kv_pool.shape[3])


def past_tables(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """A prefill chunk's block tables cut to the blocks before its first position (at least one).

    The graph attends the chunk's own tokens from their new keys, and a query reads past slot
    s only when s < positions[b, 0] (``step_bias``): the blocks from there on are masked, so
    gathering them is wasted work (half a 512-token prefill's attention, in 256-token chunks).
    Reads positions[:, 0] on the host: prefill only (a decode step keeps its full table)."""
    first = int(positions[:, 0].max())
    keep = max(1, -(-first // block_size))
    return block_tables[:, :keep] if keep < block_tables.shape[1] else block_tables


def check_pool(kv_pool: torch.Tensor, device: torch.device, engine: str) -> None:
    """ValueError unless kv_pool is a contiguous fp32 pool on ``device`` (what an engine binds
    by address: a strided or converted copy would not be the registered region)."""
    if kv_pool.dtype != torch.float32 or not kv_pool.is_contiguous() or kv_pool.device != device:
        raise ValueError(f"the {engine} step binds a contiguous fp32 pool on {device} in place, got "
                         f"{kv_pool.dtype} on {kv_pool.device}{'' if kv_pool.is_contiguous() else ', strided'}")


@dataclass
class StepBuffers:
    """One shape's inputs (the graph's ``INPUTS`` but the pool) and outputs, on one device."""
    shape: StepShape
    input_ids: torch.Tensor      # (B, T) int64
    positions: torch.Tensor      # (B, T) int64
    slot_mapping: torch.Tensor   # (B * T,) int64
    block_tables: torch.Tensor   # (B, nb) int64
    attn_bias: torch.Tensor      # (B, 1, T, nb * bs + T) fp32
    hidden: torch.Tensor         # (B, T, D) fp32: the step's result
    kv_rows: torch.Tensor | None  # (2 * L * B * T, KV, hd) fp32, for kv_out="rows" graphs
    scratch: torch.Tensor        # (B, T) int64: slots in the scratch block, for padding tokens

    @classmethod
    def allocate(cls, shape: StepShape, cfg: ModelConfig, device: torch.device, *,
                 rows: bool) -> "StepBuffers":
        B, T, nb, bs = shape.batch, shape.tokens, shape.table_blocks, shape.block_size
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        n = B * T
        kv_rows = (torch.zeros(2 * cfg.num_layers * n, cfg.num_kv_heads, cfg.head_dim, **f32)
                   if rows else None)
        scratch = (torch.arange(n, **i64) % bs + SCRATCH_BLOCK * bs).view(B, T)
        return cls(shape, torch.zeros(B, T, **i64), torch.zeros(B, T, **i64),
                   scratch.reshape(-1).clone(), torch.full((B, nb), SCRATCH_BLOCK, **i64),
                   torch.zeros(B, 1, T, nb * bs + T, **f32),
                   torch.zeros(B, T, cfg.hidden_size, **f32), kv_rows, scratch)

    def named(self) -> dict[str, torch.Tensor]:
        """The buffers by graph tensor name (the pool is bound by the engine)."""
        named = {"input_ids": self.input_ids, "positions": self.positions,
                 "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
                 "attn_bias": self.attn_bias, "hidden": self.hidden}
        if self.kv_rows is not None:
            named["kv_rows"] = self.kv_rows
        return named

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             block_tables: torch.Tensor, slot_valid: torch.Tensor | None) -> None:
        """Copy one call's inputs in, padded to the shape (in place: no address changes)."""
        B, T = input_ids.shape
        nb = block_tables.shape[1]
        self.input_ids[:, :T].copy_(input_ids)
        self.positions[:, :T].copy_(positions)
        slots = self.slot_mapping.view(B, -1)
        slots[:, :T].copy_(slot_mapping.view(B, T))
        self.block_tables[:, :nb].copy_(block_tables)
        if T < self.shape.tokens:   # padding tokens: token 0 at the row's last position, scratch slots
            self.input_ids[:, T:].zero_()
            self.positions[:, T:].copy_(positions[:, -1:].expand(B, self.shape.tokens - T))
            slots[:, T:].copy_(self.scratch[:, T:])
        if nb < self.shape.table_blocks:
            self.block_tables[:, nb:].fill_(SCRATCH_BLOCK)
        S = self.shape.table_blocks * self.shape.block_size
        key_valid = None if slot_valid is None else slot_valid[self.block_tables].view(B, S)
        self.attn_bias.copy_(step_bias(self.positions, S, key_valid))
