"""GPT-family regex pre-tokenization as tensor operations: piece starts of a whole text at once.

A regex split is sequential by nature (each match starts where the last one ended), but the
GPT-family patterns (GPT-2's, cl100k's, Qwen's, Llama 3's) have a property that makes it
parallel: the length of the match *if one starts at i* depends only on the text around i. So:

1. every code point gets its class bits from a table (letter, digit, white space, ...);
2. run lengths (letters, digits, "other", white space, newlines from i) by reverse cummin;
3. ``length[i]``: the first alternative of the pattern that matches at i, with the length its
   greedy / possessive quantifiers and its ``(?!\\S)`` backtracking give (``_lengths``);
4. the matches are the chain 0, next(0), next(next(0)), ... with next(i) = i + length[i]:
   marked for all i at once by pointer doubling (log2(n) rounds of gather + scatter).

The input is UTF-8 bytes (decoded on the device); the output is the byte offset of every piece
start. ``Spec`` names one pattern's variant; ``SPECS`` holds the verified ones, whose splits the
tests compare with the regex engine on the differential corpus. Plain torch: CPU and CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# class bits of a code point (the table is built by the caller, from the regex engine's classes)
L, N, W, NL, SP, APOS = 1, 2, 4, 8, 16, 32   # \p{L}, \p{N}, \s, [\r\n], ' ', "'"


@dataclass(frozen=True)
class Spec:
    """One GPT-family pattern, as the variant of each alternative it uses."""
    name: str
    contractions_ci: bool   # (?i:'s|...): case-insensitive contractions
    prefix: str             # letter-run prefix: "space" (' ?\\p{L}+') or "any" ([^\\r\\n\\p{L}\\p{N}]?)
    digits: int             # digit piece length cap: 1, 3, or 0 (' ?\\p{N}+', unbounded)
    other_newlines: bool    # ' ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*' (else without the newline tail)
    ws_end: bool            # '\\s++$' comes before the newline alternative
    newline_alt: bool       # '\\s*[\\r\\n]' / '\\s*[\\r\\n]+' (both end after the run's last newline)


# keyed as capsule.tokenize.patterns.VERIFIED names the patterns
SPECS = {s.name: s for s in (
    Spec("cl100k-pattern", True, "any", 3, True, True, True),
    Spec("llama3-pattern", True, "any", 3, True, False, True),
    Spec("qwen2-pattern", True, "any", 1, True, False, True),
    Spec("r50k-pattern", False, "space", 0, False, True, False),
    Spec("gpt2-pattern", False, "space", 0, False, False, False))}


def decode_utf8(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(code points (n,) int64, byte offset of each) of valid UTF-8 bytes (uint8, on any device)."""
    b = data.to(torch.int64)
    lead = torch.nonzero((b & 0xC0) != 0x80).flatten()                     # (n,)
    first = b[lead]
    size = torch.where(first < 0x80, 1, torch.where(first < 0xE0, 2, torch.where(first < 0xF0, 3, 4)))
    cp = torch.where(size == 1, first, torch.where(size == 2, first & 0x1F,
                                                   torch.where(size == 3, first & 0x0F, first & 0x07)))
    for k in (1, 2, 3):                                                    # continuation bytes
        idx = (lead + k).clamp_(max=b.numel() - 1)
        cp = torch.where(size > k, (cp << 6) | (b[idx] & 0x3F), cp)
    return cp, lead


def _run(mask: torch.Tensor) -> torch.Tensor:
    """Length of the run of True starting at each position (0 where False)."""
    n = mask.numel()
    idx = torch.arange(n, device=mask.device)
    stop = torch.where(mask, n, idx)                        # first False at or after i
    stop = torch.flip(torch.cummin(torch.flip(stop, (0,)), 0).values, (0,))
    return stop - idx


def _at(x: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
    """x shifted left by k: x[i + k], ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if k < x.numel():
        out[:x.numel() - k] = x[k:]
    return out


def _lengths(cp: torch.Tensor, bits: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Length of the match starting at each position, by the pattern's alternatives in order."""
    n = cp.numel()
    idx = torch.arange(n, device=cp.device)
    is_l, is_n, is_w = (bits & L) != 0, (bits & N) != 0, (bits & W) != 0
    is_nl, is_sp = (bits & NL) != 0, (bits & SP) != 0
    is_o = ~(is_l | is_n | is_w)
    l_run, n_run, o_run, w_run, nl_run = _run(is_l), _run(is_n), _run(is_o), _run(is_w), _run(is_nl)
    out = torch.zeros(n, dtype=torch.int64, device=cp.device)

    def take(length: torch.Tensor) -> None:   # an alternative, where no earlier one matched
        out.copy_(torch.where((out == 0) & (length > 0), length, out))

    # 1. contractions: 's 't 'm 'd (2 chars), 're 've 'll (3)
    c1, c2 = _at(cp, 1), _at(cp, 2)
    if spec.contractions_ci:   # ASCII case folding, and U+017F (long s) folds to s
        c1 = torch.where((c1 >= 65) & (c1 <= 90), c1 + 32, torch.where(c1 == 0x17F, 115, c1))
        c2 = torch.where((c2 >= 65) & (c2 <= 90), c2 + 32, torch.where(c2 == 0x17F, 115, c2))
    apos = (bits & APOS) != 0
    two = apos & ((c1 == 115) | (c1 == 116) | (c1 == 109) | (c1 == 100))            # s t m d
    three = apos & (((c1 == 114) & (c2 == 101)) | ((c1 == 118) & (c2 == 101))
                    | ((c1 == 108) & (c2 == 108)))                                   # re ve ll
    take(torch.where(two, 2, torch.where(three, 3, 0)))
    # 2. letters, with an optional one-char prefix
    l1 = _at(l_run, 1)
    pre = is_sp if spec.prefix == "space" else ~(is_nl | is_l | is_n)
    take(torch.where(is_l, l_run, torch.where(pre & (l1 > 0), 1 + l1, 0)))
    # 3. digits
    if spec.digits:
        take(torch.where(is_n, n_run.clamp(max=spec.digits), 0))
    else:
        n1 = _at(n_run, 1)
        take(torch.where(is_n, n_run, torch.where(is_sp & (n1 > 0), 1 + n1, 0)))
    # 4. other: ' ?[^\s\p{L}\p{N}]+', then newlines
    o1 = _at(o_run, 1)
    other = torch.where(is_o, o_run, torch.where(is_sp & (o1 > 0), 1 + o1, 0))
    if spec.other_newlines:
        end = (idx + other).clamp(max=n - 1)
        other = torch.where(other > 0, other + torch.where(idx + other < n, nl_run[end], 0), 0)
    take(other)
    # 5.-8. white space
    to_end = is_w & (idx + w_run == n)
    if spec.ws_end:                                   # \s++$
        take(torch.where(to_end, w_run, 0))
    if spec.newline_alt:                              # \s*[\r\n]+: up to the run's last newline
        nl_pos = torch.where(is_nl, idx, -1)
        run_end = idx + w_run                          # exclusive, for white-space positions
        last_nl = torch.cummax(nl_pos, 0).values       # last newline at or before each position
        at_end = last_nl[(run_end - 1).clamp(min=0)]
        take(torch.where(is_w & (at_end >= idx), at_end - idx + 1, 0))
    take(torch.where(to_end, w_run, torch.where(is_w & (w_run >= 2), w_run - 1, 0)))  # \s+(?!\S)
    take(torch.where(is_w, 1, 0))                     # \s / \s+ (a single one, here)
    return out


def piece_starts(cp: torch.Tensor, table: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Indices (into ``cp``) of every piece start, ascending; ``table`` maps a code point to its
    class bits (uint8, 0x110000 entries, on cp's device)."""
    n = cp.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=cp.device)
    bits = table[cp].to(torch.int64)
    nxt = torch.arange(n, device=cp.device) + _lengths(cp, bits, spec)   # every length >= 1
    nxt = torch.cat([nxt.clamp_(max=n), torch.tensor([n], device=cp.device)])  # n: the end
    mark = torch.zeros(n + 1, dtype=torch.uint8, device=cp.device)
    mark[0] = 1
    jumps = [nxt]
    while (1 << len(jumps)) <= n:                     # next^(2^k) for every k with 2^k <= n
        jumps.append(jumps[-1][jumps[-1]])
    for jump in reversed(jumps):   # marked nodes mark the node 2^k matches ahead (dense: no sync)
        mark = mark.scatter_reduce(0, jump, mark, reduce="amax")
    return torch.nonzero(mark[:n]).flatten()          # the one host sync


def split_utf8(data: torch.Tensor, table: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Byte offsets of every piece start of the UTF-8 text ``data`` (uint8)."""
    cp, offsets = decode_utf8(data)
    return offsets[piece_starts(cp, table, spec)]
