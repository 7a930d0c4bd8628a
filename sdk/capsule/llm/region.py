"""A stream's memory region: a block-aligned run of positions between its prefix and the rest.

Layout of a stream with a region (positions; see docs/MEMORY.md):

    [prefix tokens 0..gap_at) [hole to the block end) [region: a hole, then the facts packed] [rest]

Facts are packed against the region's END, so the rest follows the last fact with no gap in
positions: a trained model reads a position gap right before the question as a break in the
text (SmolLM2-135M, one fact: 95% of answers right with no gap, 0% with a 15-position gap;
docs/MEMORY.md). Tokens from ``gap_at`` on sit behind the region (BlockTable.gap), so changing
which facts fill the region never moves or recomputes the rest's K/V. Holes are slots attention must not read
(``pool.slot_valid``). Facts arrive as pre-RoPE keys and values and are rotated to their
positions and scattered into the region's blocks by ``edge_kernels.rope.rotate_scatter``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from edge_kernels.rope import check_reinjectable, rotate_scatter_tokens

from .kv_pool import BlockTable
from .model import Decoder


@dataclass
class Region:
    """Where a stream's region lies and which facts fill it: (fact id, position, n_tokens)."""
    gap_at: int
    start: int
    size: int
    facts: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def fact_ids(self) -> tuple[int, ...]:
        return tuple(f for f, _, _ in self.facts)

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def used(self) -> tuple[int, int]:
        """Positions [lo, hi) the facts fill: a contiguous run against the region's end (or,
        in a capsule of an older version, its start); (end, end) when empty."""
        if not self.facts:
            return self.end, self.end
        return self.facts[0][1], self.facts[-1][1] + self.facts[-1][2]

    def to_json(self) -> dict:
        return {"gap_at": self.gap_at, "start": self.start, "size": self.size,
                "facts": [list(f) for f in self.facts]}

    @classmethod
    def from_json(cls, m: object, block_size: int, max_context: int) -> "Region":
        """Parse saved state (untrusted): every number range-checked, facts inside the region."""
        if not isinstance(m, dict):
            raise ValueError("region must be an object")
        vals = [m.get(k) for k in ("gap_at", "start", "size")]
        if any(type(v) is not int or v < 0 for v in vals):
            raise ValueError(f"region fields must be ints >= 0, got {vals}")
        gap_at, start, size = vals
        if start % block_size or size % block_size or size == 0 or start + size > max_context \
                or start != -(-gap_at // block_size) * block_size:
            raise ValueError(f"region {start}+{size} is not block-aligned after its prefix or "
                             f"exceeds max_context {max_context}")
        raw = m.get("facts") or []
        if not isinstance(raw, list) or len(raw) > size:
            raise ValueError("region facts must be a list of at most one entry per position")
        facts: list[tuple[int, int, int]] = []
        for f in raw:
            if not (isinstance(f, list) and len(f) == 3 and all(type(x) is int for x in f)) \
                    or f[2] < 1 or f[1] < start or f[1] + f[2] > start + size \
                    or (facts and f[1] != facts[-1][1] + facts[-1][2]):
                raise ValueError(f"region fact entry {f!r} is not packed inside the region")
            facts.append((f[0], f[1], f[2]))
        region = cls(gap_at, start, size, facts)
        lo, hi = region.used
        if facts and lo != start and hi != region.end:   # packed against neither end
            raise ValueError(f"region facts fill {lo}..{hi}: not packed against the region's end")
        return region


def span(gap_at: int, region_tokens: int, block_size: int) -> tuple[int, int]:
    """(start, size) of a region after gap_at prefix tokens: both block-aligned."""
    if region_tokens < 1:
        raise ValueError(f"region_tokens must be >= 1, got {region_tokens}")
    return -(-gap_at // block_size) * block_size, -(-region_tokens // block_size) * block_size


def reserve(table: BlockTable, gap_at: int, region_tokens: int, covered: int = 0) -> Region:
    """Put an empty region after the first gap_at tokens; later tokens move behind it.

    The caller drops cached K/V from gap_at on (it sits at the old positions). covered: fact
    tokens the caller writes against the region's end right away (fill): the new blocks they
    wholly cover are not zeroed first (zeroing 2048 positions only to overwrite most of them
    cost ~1 ms); if that write fails, the caller zeroes them (zero_covered).
    """
    bs = table.pool.block_size
    start, size = span(gap_at, region_tokens, bs)
    table.truncate(gap_at)
    first_new = table.reserve_gap(gap_at, start + size - gap_at, (start + size) // bs, zero=False)
    lo, hi = _covered_blocks(start + size, min(covered, size), bs)
    table.pool.zero([b for j, b in enumerate(table.blocks[first_new:], first_new) if not lo <= j < hi])
    region = Region(gap_at, start, size)
    mark_holes(table, region)
    return region


def zero_covered(table: BlockTable, region: Region, covered: int) -> None:
    """Zero the blocks reserve(covered=...) left for the fill, when the fill did not happen."""
    bs = table.pool.block_size
    lo, hi = _covered_blocks(region.end, min(covered, region.size), bs)
    table.pool.zero(table.blocks[lo:hi])


def _covered_blocks(end: int, covered: int, bs: int) -> tuple[int, int]:
    # block indices [lo, hi) wholly inside positions end - covered .. end - 1
    return -(-(end - covered) // bs), end // bs


def mark_holes(table: BlockTable, region: Region) -> None:
    """Set slot_valid (and the blocks prefill may skip) from the region's layout."""
    lo, hi = region.used
    table.set_valid(region.gap_at, region.end, False)
    table.set_valid(lo, hi, True)
    # the facts are one run against one end: the blocks wholly on the other side hold nothing
    # readable, and prefill and eager decode skip them
    bs = table.pool.block_size
    if hi == region.end:
        table.skip = (region.start // bs, lo // bs)
    else:                                  # an older capsule's region, packed from the start
        table.skip = (-(-hi // bs), region.end // bs)


def fill(table: BlockTable, region: Region, model: Decoder,
         facts: Sequence[tuple[int, torch.Tensor]], key_scales: Sequence[float] | None = None) -> None:
    """Replace the region's facts: (fact id, kv), kv token-major (T, L, 2, KV, hd) pre-RoPE
    keys and values (FactKV.kv), packed in order against the region's end (the last one
    right before the rest). key_scales: one per fact, what its keys are multiplied by
    (MemoryConfig.key_scales: temperature and rank decay); None: unscaled."""
    check_reinjectable(model.cfg.rope)
    total = sum(kv.shape[0] for _, kv in facts)
    if total > region.size:
        raise ValueError(f"the {len(facts)} facts hold {total} tokens; the memory region holds "
                         f"{region.size} (raise MemoryConfig.region_tokens or lower memory_k)")
    if key_scales is not None and len(key_scales) != len(facts):
        raise ValueError(f"key_scales holds {len(key_scales)} scales for {len(facts)} facts: give one "
                         "per fact")
    old_lo, old_hi = region.used
    lo = region.end - total
    region.facts = []
    mark_holes(table, region)   # all holes until the new facts are written
    # the old facts' K/V outside the new run: masked, but wiped so a forgotten fact's bytes
    # leave the pool (and the next capsule) with it
    by_token = table.pool.tensor.permute(0, 3, 1, 2, 4, 5)               # (NB, bs, L, 2, KV, hd)
    bs = table.pool.block_size
    for a, b in ((old_lo, min(old_hi, lo)), (max(old_lo, region.end), old_hi)):
        if a < b:
            slots = table.slot_range(a, b)
            by_token[torch.div(slots, bs, rounding_mode="floor"), slots % bs] = 0
    if not facts:
        return
    placed, at = [], lo
    for fid, kv in facts:
        placed.append((fid, at, kv.shape[0]))
        at += kv.shape[0]
    dev = table.pool.tensor.device
    scale: float | torch.Tensor = 1.0 if key_scales is None else \
        torch.tensor(key_scales, dtype=torch.float32).repeat_interleave(
            torch.tensor([kv.shape[0] for _, kv in facts]))                 # (sum T,) one per token
    # all facts in one rotate + scatter pass: (sum T, L, 2, KV, hd); a scale > 1 / < 1 is the
    # sharper / softer attention over facts encoded apart (APE's temperature)
    rotate_scatter_tokens(table.pool.tensor, [kv for _, kv in facts], torch.arange(lo, region.end, device=dev),
                          table.slot_range(lo, region.end), model.rope_cos, model.rope_sin, scale)
    region.facts = placed
    mark_holes(table, region)
