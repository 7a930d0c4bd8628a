"""Token sampling: greedy, or temperature / top-p with an explicit per-stream generator.

The generator's state is execution state: a seeded stream replays the same tokens, and a
capsule that saves `generator.get_state()` resumes the same sequence after a restore.

One step samples the whole batch at once. Greedy rows are one argmax over the batch. Each
sampled row draws its noise, a fixed count of uniforms per step, from its own stream's
generator into its row of a preallocated buffer; then one batched kernel does temperature,
the top-p cut and the pick for every row together. Every operation is row-wise (a row's
result depends on its logits, its parameters and its own draws only), so a stream samples
the same tokens alone or in a batch with others.

The pick is an exponential race (argmax of p / E, E ~ Exp(1)), the draw torch.multinomial
makes: a tiny change of the logits (a decoder's batch-size rounding) almost never changes
the winner, where an inverse CDF would move by the mass of the whole vocabulary before the
pick. Racing V tokens would need V draws a step, so the race runs in two levels: the
vocabulary is cut into G groups of S tokens (G * S >= V, ~2 sqrt(V) draws a step), a race
over the groups' masses picks a group, a race inside it picks the token.

The top-p cut keeps every token whose probability is at least the nucleus boundary's,
t* = the largest p with mass(p' >= p) >= top_p (ties at the boundary are all kept). On CPU t*
is found without sorting: a radix select over the probabilities' bit patterns, two passes
of a 2^15-bin mass histogram (a sort of 4 x 100K floats costs ~15 ms on 2 cores). Elsewhere
(CUDA) a segmented sort finds it (fast there; histograms would need atomics, whose float
sums are not reproducible), and every kernel runs over all max_rows rows, so that no kernel
picks another algorithm (another rounding) for another batch size.
"""
from __future__ import annotations

from dataclasses import dataclass
import os
from typing import Protocol, Sequence

import torch

BITS = 15
BINS = 1 << BITS      # histogram bins per radix pass: p >= 0 has bits < 2^30 (1.0 is 0x3F800000)
GROUPS = 32           # race groups (at most): S = V / GROUPS tokens each
ALIGN = 16            # group length is a multiple of this: every group starts equally aligned
TINY = 1e-30          # uniforms are clamped to it: log(u) stays finite


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest nucleus with that mass."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class _Rows:
    """Views of a Sampler's buffers for the first `rows` rows: made once, reused every step."""

    x: torch.Tensor; p: torch.Tensor; w: torch.Tensor; idx: torch.Tensor     # (rows, Vp)
    key: torch.Tensor; h: torch.Tensor   # (rows, Vp) int64; (rows, BINS)
    c: torch.Tensor                       # (rows, BINS), or (rows, Vp) when sorting
    noise: torch.Tensor; gsum: torch.Tensor; race: torch.Tensor  # (rows, G + S); (rows, G)
    wg: torch.Tensor; race_g: torch.Tensor                       # (rows, 1, S); (rows, S)
    temps: torch.Tensor; top_p: torch.Tensor; cuts: torch.Tensor; thr: torch.Tensor  # (rows, 1)
    below: torch.Tensor; t: torch.Tensor; t_bits: torch.Tensor                        # (rows, 1)
    bin: torch.Tensor; cut: torch.Tensor; g: torch.Tensor; j: torch.Tensor  # (rows, 1) long
    greedy: torch.Tensor; am: torch.Tensor; pick: torch.Tensor             # (rows,)

    def __init__(self, buf: dict[str, torch.Tensor], rows: int, vocab: int, groups: int, size: int):
        for name, t in buf.items():
            setattr(self, name, t[:rows])
        self.x_vocab = self.x[:, :vocab]                    # (rows, V): the logits' columns
        self.noise_rows = list(self.noise)                  # (G + S,) each: one stream's draws
        self.w3 = self.w.view(rows, groups, size)           # (rows, G, S)
        self.g3 = self.g.view(rows, 1, 1).expand(rows, 1, size)   # the picked group, per token
        self.wg0 = self.wg[:, 0]                            # (rows, S): the picked group's mass
        self.log_g, self.log_s = self.noise[:, :groups], self.noise[:, groups:]
        self.c_last = self.c[:, -1:]                        # (rows, 1): a cumulative's total
        self.tok = self.pick.view(rows, 1)                  # (rows, 1): the sampled tokens


class Sampler:
    """Samples one token per row of (n, V) logits, n <= max_rows, over buffers allocated once
    (~28 bytes per row and vocabulary entry, e.g. 11 MB for 4 x 100K).

    Not thread-safe (one per runner; the Session serializes calls). The result of `sample` is
    a view of a buffer that the next call overwrites: read it (or copy it) before then.
    """

    def __init__(self, max_rows: int, vocab: int, device: torch.device | str,
                 nucleus: str | None = None):
        if max_rows < 1 or vocab < 1:
            raise ValueError(f"max_rows and vocab must be >= 1, got {max_rows}, {vocab}")
        self.device = torch.device(device)
        if nucleus is None:     # a histogram's cost is ~BINS per row: small vocabularies sort
            nucleus = "histogram" if self.device.type == "cpu" and vocab >= 4096 else "sort"
        if nucleus not in ("histogram", "sort"):
            raise ValueError(f"nucleus must be 'histogram' or 'sort', got {nucleus!r}")
        self.nucleus, self.max_rows, self.vocab = nucleus, max_rows, vocab
        size = -(-vocab // GROUPS)
        self.size = -(-size // ALIGN) * ALIGN                 # S: tokens per group
        self.groups = -(-vocab // self.size)                  # G
        self.noise_count = self.groups + self.size            # uniforms a sampled step draws
        B, Vp, f32, i64 = max_rows, self.groups * self.size, torch.float32, torch.long

        def new(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
            # written before read each step: no zeroing (greedy-only sessions never touch them)
            return torch.empty(*shape, dtype=dtype, device=self.device)

        def zero(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)
        x = zero(B, Vp)
        x[:, vocab:] = float("-inf")      # the padding to G * S tokens: p = 0, never picked
        buf = {"x": x, "p": new(B, Vp), "w": new(B, Vp), "idx": new(B, Vp, dtype=i64),
               "noise": zero(B, self.noise_count), "gsum": new(B, self.groups),
               "race": new(B, self.groups), "wg": new(B, 1, self.size), "race_g": new(B, self.size),
               "temps": zero(B, 1), "top_p": zero(B, 1), "cuts": zero(B, 1), "thr": zero(B, 1),
               "below": zero(B, 1), "t": zero(B, 1), "t_bits": zero(B, 1, dtype=torch.int32),
               "bin": zero(B, 1, dtype=i64), "cut": zero(B, 1, dtype=i64),
               "g": zero(B, 1, dtype=i64), "j": zero(B, 1, dtype=i64),
               "greedy": zero(B, dtype=torch.bool), "am": zero(B, dtype=i64), "pick": zero(B, dtype=i64)}
        if nucleus == "histogram":
            buf |= {"key": new(B, Vp, dtype=i64), "h": new(B, BINS), "c": new(B, BINS)}
        else:
            buf["c"] = new(B, Vp)                           # the sorted row's cumulative mass
        self._buf = buf
        self._rows: dict[int, _Rows] = {}
        self._loaded: list[SamplingParams | None] = [None] * B

    def _views(self, rows: int) -> _Rows:
        r = self._rows.get(rows)
        if r is None:
            r = self._rows[rows] = _Rows(self._buf, rows, self.vocab, self.groups, self.size)
        return r

    def rows(self, logits: torch.Tensor, params: Sequence[SamplingParams],
             generators: Sequence[torch.Generator | None]) -> list[int]:
        """One token per row, read back to the host once (the step's only device read)."""
        return self.sample(logits, params, generators).tolist()

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One token per row of logits (n, V), as an (n,) long tensor on the logits' device.

        Hot path: no host sync and no allocation per step (the parameters are uploaded only
        when they change, e.g. once per generate call).
        """
        n = logits.shape[0]
        if not len(params) == len(generators) == n:
            raise ValueError("one SamplingParams and one generator per logits row are needed")
        if not 1 <= n <= self.max_rows or logits.dim() != 2 or logits.shape[1] != self.vocab:
            raise ValueError(f"logits must be (n, {self.vocab}) with 1 <= n <= {self.max_rows}, "
                             f"got {tuple(logits.shape)}")
        live = self._views(n)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return torch.argmax(logits, dim=-1, out=live.pick)                 # (n,)
        for p, gen in zip(params, generators):
            if not p.greedy and gen is None:
                raise ValueError("sampling with temperature > 0 needs a generator (pass seed=)")
        self._load(live, params)
        for i, (p, gen) in enumerate(zip(params, generators)):
            if not p.greedy:
                live.noise_rows[i].uniform_(generator=gen)   # the stream's own draws
        # CUDA: every kernel over all rows (fixed shapes); CPU: over the live rows only
        r = self._views(self.max_rows) if self.device.type == "cuda" else live
        torch.div(logits, live.temps, out=live.x_vocab)                        # (n, V) f32
        torch.softmax(r.x, dim=-1, out=r.p)     # row-wise kernel: a row's result is its own
        if any(not p.greedy and p.top_p < 1.0 for p in params):
            if self.nucleus == "histogram":
                self._cut_histogram(r)
            else:
                self._cut_sort(r)
            r.t.mul_(r.cuts)                                  # rows without a cut: t* = 0
            # kept mass p * [p >= t*], the mask in float32 (a bool one costs a cast per step)
            torch.ge(r.p, r.t, out=r.w).mul_(r.p)                              # (rows, Vp)
        else:
            r.w.copy_(r.p)
        self._race(r)
        if any(greedy):
            torch.argmax(logits, dim=-1, out=live.am)
            torch.where(live.greedy, live.am, live.pick, out=live.pick)
        return live.pick

    # -- the batched kernel (no host sync / no allocation per step) ---------------------------
    def _load(self, r: _Rows, params: Sequence[SamplingParams]) -> None:
        """Temperatures, top-p and the greedy mask of the rows, uploaded only when they change."""
        if all(a == b for a, b in zip(self._loaded, params)):
            return
        col = [(p.temperature, p.top_p, float(p.top_p < 1.0)) if not p.greedy else (1.0, 1.0, 0.0)
               for p in params]
        r.temps.copy_(torch.tensor([c[0] for c in col]).view(-1, 1))
        r.top_p.copy_(torch.tensor([c[1] for c in col]).view(-1, 1))
        r.cuts.copy_(torch.tensor([c[2] for c in col]).view(-1, 1))
        r.greedy.copy_(torch.tensor([p.greedy for p in params]))
        self._loaded[:len(params)] = params

    def _race(self, r: _Rows) -> None:
        """r.pick = the race winner of the kept mass r.w: a group by its mass, then a token in it."""
        # -log(u) ~ Exp(1); log per row: a vectorized and a scalar log may differ in the last
        # bit, and which one an element gets depends on where it sits in the batched tensor
        r.noise.clamp_(min=TINY)
        for row in r.noise_rows:
            row.log_()
        torch.sum(r.w3, dim=-1, out=r.gsum)                                    # (rows, G)
        # argmax p / E = argmin p / log(u): log(u) < 0; a massless group or token is 0, last
        torch.div(r.gsum, r.log_g, out=r.race)
        torch.argmin(r.race, dim=-1, keepdim=True, out=r.g)                    # (rows, 1)
        torch.gather(r.w3, 1, r.g3, out=r.wg)                                  # (rows, 1, S)
        torch.div(r.wg0, r.log_s, out=r.race_g)
        torch.argmin(r.race_g, dim=-1, keepdim=True, out=r.j)
        torch.mul(r.g, self.size, out=r.tok).add_(r.j)                          # (rows, 1)

    def _cut_histogram(self, r: _Rows) -> None:
        """r.t = t* per row, by a 2-pass radix select on the bits of p (p >= 0: ascending bits
        are ascending p; they are < 2^30: the high 15 bits, then the low 15 bits)."""
        r.key.copy_(r.p.view(torch.int32))                       # (rows, Vp) int64, no temporary
        torch.bitwise_right_shift(r.key, BITS, out=r.idx)       # pass 1: bins by the high bits
        self._boundary(r, first=True)                            # r.bin = the boundary bin b
        # pass 2, inside b by the low bits; the tokens below b (lower p) join bin 0 and those
        # above it the last bin: a cumulative mass inside b then counts all the tokens below,
        # and only the last one (the row's total) changes
        torch.mul(r.bin, BINS, out=r.cut)                        # (rows, 1): b's lowest bits
        torch.sub(r.key, r.cut, out=r.idx).clamp_(0, BINS - 1)
        self._boundary(r, first=False)
        r.t_bits.copy_(r.cut.add_(r.bin))                        # the boundary token's bits
        r.t.copy_(r.t_bits.view(torch.float32))

    @staticmethod
    def _boundary(r: _Rows, first: bool) -> None:
        """Mass histogram of r.p over bins r.idx (ascending p); r.bin = the highest bin b whose
        tokens and those above hold thr (top_p of the row's total): the mass below b, c[b - 1],
        stays <= total - thr, so b = the count of cumulative masses <= total - thr."""
        r.h.zero_().scatter_add_(1, r.idx, r.p)         # (rows, BINS), each row in its own order
        torch.cumsum(r.h, dim=-1, out=r.c)              # non-decreasing: a sorted row
        if first:
            torch.mul(r.top_p, r.c_last, out=r.thr)
        torch.sub(r.c_last, r.thr, out=r.below)         # the mass the cut may leave out
        torch.searchsorted(r.c, r.below, right=True, out=r.bin).clamp_(max=BINS - 1)

    def _cut_sort(self, r: _Rows) -> None:
        """r.t = t* per row, from a descending sort and its cumulative mass."""
        torch.sort(r.p, dim=-1, descending=True, out=(r.w, r.idx))             # (rows, Vp)
        torch.cumsum(r.w, dim=-1, out=r.c)
        torch.mul(r.top_p, r.c_last, out=r.thr)
        torch.searchsorted(r.c, r.thr, out=r.bin).clamp_(max=r.c.shape[1] - 1)  # first to reach it
        torch.gather(r.w, 1, r.bin, out=r.t)                   # the boundary token's p


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of logits (n, V), with a one-off Sampler (it allocates its buffers:
    a decode loop keeps one Sampler instead, e.g. GraphRunner.sampler)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (n, V), got {tuple(logits.shape)}")
    return Sampler(logits.shape[0], logits.shape[1], logits.device).rows(logits, params, generators)


def stream_generator(current: torch.Generator | None, params: SamplingParams, seed: int | None,
                     device: torch.device) -> torch.Generator | None:
    """The generator a stream samples with for one generate call: reseeded by ``seed``; kept
    when it has one; a fresh random one for unseeded sampling (its state is execution state,
    saved in capsules); None while greedy."""
    if seed is not None:
        return make_generator(seed, device)
    if current is None and not params.greedy:
        return make_generator(int.from_bytes(os.urandom(8), "little") >> 1, device)
    return current


class _Decoder(Protocol):
    vocab_size: int

    def decode_bytes(self, ids: list[int]) -> bytes: ...


def sample_decodable(sampler: Sampler, tokenizer: _Decoder, logits: torch.Tensor, params: SamplingParams,
                     generators: list[torch.Generator | None]) -> list[tuple[int, bytes]]:
    """One (token, its bytes) per row of logits, never a token the tokenizer cannot decode: model
    rows past the tokenizer's ids are masked, and an unassigned id inside the vocabulary (e.g.
    cl100k's gaps) is masked and that row drawn again (a rare second host read)."""
    vocab = tokenizer.vocab_size
    if logits.shape[-1] > vocab:
        logits[:, vocab:] = float("-inf")
    picks = sampler.rows(logits, [params] * len(generators), generators)
    result = []
    for row, tok in enumerate(picks):
        while True:
            try:
                result.append((tok, tokenizer.decode_bytes([tok])))
                break
            except ValueError:
                logits[row, tok] = float("-inf")
                tok = sampler.rows(logits[row:row + 1], [params], [generators[row]])[0]
    return result
