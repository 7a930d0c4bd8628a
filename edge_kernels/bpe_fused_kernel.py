"""The Triton kernel of edge_kernels.bpe_fused, in a module of its own so that `triton` and `tl`
are module globals (Triton's interpreter remaps what a kernel finds in its globals; see
paged_decode_kernel.py). Imported lazily: triton picks the interpreter when this is imported.

One program runs one row to completion, all rounds in registers: no host sync, no launch per
round. A merged pair leaves a hole (-1) instead of compacting the row each round; neighbours
are found from running counts (`tl.cumsum`) by binary searches of `tl.gather`s.
"""
import triton
import triton.language as tl


@triton.jit
def _first_at_least(cum, target, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """Per element: the first slot i of its row with cum[i] >= target (BLOCK if none), for a
    non-decreasing cum. A binary search of LOG = log2(BLOCK) + 1 gathers: scans with a custom
    combine are a Python loop per element under the interpreter, cumsum and gather are not."""
    lo = tl.zeros(target.shape, tl.int32)
    hi = tl.full(target.shape, BLOCK, tl.int32)
    for _ in tl.static_range(LOG):
        mid = (lo + hi) // 2
        below = (tl.gather(cum, tl.minimum(mid, BLOCK - 1), 1) < target) & (mid < BLOCK)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, tl.minimum(mid, hi))
    return lo


@triton.jit
def _lookup(left, right, KEYS, VALUES, stride, MUL_L, MUL_R, SHIFT, MASK,
            NO_RANK: tl.constexpr):
    """(rank, merged id) of the pairs (left, right); NO_RANK / -1 where either is -1 or the
    pair never merges. Linear probing from the pair's home slot until its key or an empty slot
    (the table ends in empty slots, so a probe never runs past it)."""
    valid = (left >= 0) & (right >= 0)
    lv = tl.where(valid, left, 0)
    rv = tl.where(valid, right, 0)
    key = lv * stride + rv
    h = ((lv * MUL_L + rv * MUL_R) >> SHIFT) & MASK
    rank = tl.full(left.shape, NO_RANK, tl.int64)
    merged = tl.full(left.shape, -1, tl.int64)
    pending = valid
    while tl.max(tl.max(pending.to(tl.int32), 1), 0) > 0:
        k = tl.load(KEYS + h, mask=pending, other=-1)
        hit = pending & (k == key)
        v = tl.load(VALUES + h, mask=hit, other=0)             # rank << 32 | merged id
        rank = tl.where(hit, v >> 32, rank)
        merged = tl.where(hit, v & 0xFFFFFFFF, merged)
        pending = pending & (k != key) & (k != -1)
        h = h + 1
    return rank, merged


@triton.jit
def _neighbours(ids, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """Per slot of each row: the next live slot after it (BLOCK if none), the previous (-1)."""
    live = ids >= 0
    k = tl.cumsum(live.to(tl.int32), 1)                   # live slots at or before j
    nx = _first_at_least(k, k + 1, LOG, BLOCK)
    before = k - live.to(tl.int32)                        # live slots before j
    pv = tl.where(before >= 1, _first_at_least(k, before, LOG, BLOCK), -1)
    return nx, pv


@triton.jit
def _take(x, at, ok, other, BLOCK: tl.constexpr):
    """x[r, at[r, j]] where ok, else other (at may be out of range where not ok)."""
    return tl.where(ok, tl.gather(x, tl.minimum(tl.maximum(at, 0), BLOCK - 1), 1), other)


@triton.jit
def _pairs(ids, KEYS, VALUES, stride, MUL_L, MUL_R, SHIFT, MASK,
           NO_RANK: tl.constexpr, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """Neighbours, and the pair starting at each live slot: (ids[j], ids[nx[j]])'s rank and id."""
    nx, pv = _neighbours(ids, LOG, BLOCK)
    rank, merged = _lookup(ids, _take(ids, nx, nx < BLOCK, -1, BLOCK), KEYS, VALUES,
                           stride, MUL_L, MUL_R, SHIFT, MASK, NO_RANK)
    return nx, pv, rank, merged, tl.min(rank, 1)[:, None]


@triton.jit
def bpe_merge_kernel(IDS, OUT, KEYS, VALUES, B, W, stride, MUL_L, MUL_R, SHIFT, MASK,
                     NO_RANK: tl.constexpr, ROWS: tl.constexpr, LOG: tl.constexpr,
                     BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)[:, None]
    j = tl.arange(0, BLOCK)[None, :] + tl.zeros([ROWS, BLOCK], tl.int32)       # (R, BLOCK)
    inside = (j < W) & (r < B)
    ids = tl.load(IDS + r * W + j, mask=inside, other=-1).to(tl.int64)          # (R, BLOCK)
    nx, pv, rank, merged, rmin = _pairs(ids, KEYS, VALUES, stride, MUL_L, MUL_R,
                                        SHIFT, MASK, NO_RANK, LOG, BLOCK)
    # rounds until no row of the tile has a pair left (a finished row's rounds change nothing)
    while tl.min(tl.min(rmin, 1), 0) < NO_RANK:
        # one round of edge_kernels.bpe._round, holes instead of compaction (its docstring
        # argues why merging this prefix of rmin's occurrences equals the sequential loop)
        live = ids >= 0
        occ = (rank == rmin) & (rank < NO_RANK)
        c = tl.cumsum(occ.to(tl.int32), 1)
        # leftmost-first, non-overlapping: every other occurrence of a run; holes are transparent.
        # run_start = c at the last live non-occurrence at or before j (0 if none)
        stops = tl.cumsum((live & (~occ)).to(tl.int32), 1)
        last_stop = _first_at_least(stops, stops, LOG, BLOCK)
        run_start = tl.where(stops >= 1, _take(c, last_stop, stops >= 1, 0, BLOCK), 0)
        sel = occ & ((c - run_start) % 2 == 1)
        sel_i = sel.to(tl.int32)
        # neighbours when the sequential loop merges occurrence j: the left token is already
        # merged when the selected pair before ends right at j; the right one is not yet
        pp = _take(pv, pv, pv >= 0, -1, BLOCK)
        left_merged = _take(sel_i, pp, pp >= 0, 0, BLOCK) != 0
        left = tl.where(left_merged, _take(merged, pp, pp >= 0, -1, BLOCK),
                        _take(ids, pv, pv >= 0, -1, BLOCK))
        q = _take(nx, nx, nx < BLOCK, BLOCK, BLOCK)
        right = _take(ids, q, q < BLOCK, -1, BLOCK)
        mine = tl.where(sel, merged, -1)
        lr, _u0 = _lookup(tl.where(sel, left, -1), mine, KEYS, VALUES,
                          stride, MUL_L, MUL_R, SHIFT, MASK, NO_RANK)
        rr, _u1 = _lookup(mine, tl.where(sel, right, -1), KEYS, VALUES,
                          stride, MUL_L, MUL_R, SHIFT, MASK, NO_RANK)
        unsafe = sel & ((lr < rmin) | (rr < rmin))
        first_unsafe = tl.min(tl.where(unsafe, j, BLOCK), 1)[:, None]
        sel = sel & (j <= first_unsafe)     # the round ends right after the first unsafe merge
        sel_i = sel.to(tl.int32)
        killed = live & (_take(sel_i, pv, pv >= 0, 0, BLOCK) != 0)   # right half of a merge
        ids = tl.where(sel, merged, tl.where(killed, -1, ids))
        nx, pv, rank, merged, rmin = _pairs(ids, KEYS, VALUES, stride, MUL_L, MUL_R,
                                            SHIFT, MASK, NO_RANK, LOG, BLOCK)
    # left-align the final tokens: live slots to their rank among live slots, -1 after them
    live = ids >= 0
    dest = tl.cumsum(live.to(tl.int32), 1) - 1
    n_live = tl.sum(live.to(tl.int32), 1)[:, None]
    tl.store(OUT + r * W + dest, ids, mask=live & inside)
    tl.store(OUT + r * W + j, tl.full([ROWS, BLOCK], -1, tl.int64), mask=(j >= n_live) & inside)
