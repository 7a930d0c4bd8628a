"""Context policy of a stream that would pass runtime.max_context: "error" or "shift".

"error" (the default): the append or generate raises ContextFull (a CapacityError and a
ValueError) and nothing changes; the message names the ways out.

"shift" (as llama.cpp's context shift): before an append or generate that would not fit, the
stream drops its oldest non-system tokens and keeps the newest. Exactly what a shift changes:

- Pending generated text (a reply no append has followed yet) is folded into the stream's text
  first, as the next append would do (a reply that ended inside a UTF-8 character: U+FFFD).
- The dropped text is gone. The stream's text becomes: the system prefix (system=True text),
  then the decode of the kept ids; its ids are the reference tokenizer's ids of that text
  (one encode proves it; when it does not hold, the cut moves a token later, at most
  MAX_CUT_TRIES times, then ContextFull).
- The system prefix and the memory region stay where they are, K/V included. The kept tokens'
  K/V move right after them: values copied, keys rotated by the position delta (RoPE is a
  rotation, R(p - d) = R(-d) R(p); the model's own rope tables, llama3 scaling included, fp32,
  rounded once to the pool's dtype). Freed blocks go back to the pool. These K/V are NOT what a
  fresh prefill of the kept text would give: attention over the dropped tokens is baked into
  them, so logits after a shift differ from a fresh prefill of the same text. What holds is the
  capsule contract: the shift is deterministic and its result is ordinary stream state, so a
  shifted stream checkpoints, restores and continues bit-exactly, and a rollback to an epoch
  taken before the shift gives back the unshifted stream.
- How much: at least what the request needs, and at least half of the droppable tokens
  (llama.cpp's n_discard = n_past / 2), so that shifts stay rare; one token after the system
  prefix is always kept. The cut then moves on to the start of the next turn (a special token
  such as a chat template's <|im_start|>, else the token after a newline) when there is one, so
  the kept text begins with a whole turn.
"""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass

import torch

from devices.profile import CONTEXT_POLICIES
from edge_kernels.rope import rotate_scatter_tokens

from ..errors import ContextFull
from ..tokenize import ReferenceTokenizer
from ..tokenize.splice import common
from .kv_pool import BlockTable
from .streams import Stream

MAX_CUT_TRIES = 64     # cuts tried, a token apart, before a shift gives up
MAX_TURN_SCAN = 1024   # tokens past the plain cut searched for the start of a turn
MAX_HEAD_TRIES = 8     # tokens past the system prefix's own ids, when its last one joins the text
MOVE_CHUNK = 512       # tokens moved per pass: bounds the temporary copy (T, L, 2, KV, hd)

__all__ = ["CONTEXT_POLICIES", "ShiftPlan", "apply_shift", "check_policy", "full_error",
           "folded_text", "plan_shift"]


def check_policy(policy: object) -> str:
    if policy not in CONTEXT_POLICIES:
        raise ValueError(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got {policy!r}")
    return policy   # type: ignore[return-value]


def full_error(name: str, what: str, max_context: int, hint: str = "") -> ContextFull:
    """The "error" policy's refusal: what would not fit, and the ways out."""
    return ContextFull(
        f"stream {name!r} {what} (max_context is {max_context}); nothing changed. Ways out: "
        f"Session.drop_stream({name!r}) and start a new stream, Session.rollback(<epoch>) to an "
        "earlier capsule, or open the Session with runtime={'context_policy': 'shift'} to drop "
        f"the oldest text as the stream fills (or {hint + ', ' if hint else ''}raise runtime.max_context)")


@dataclass(frozen=True)
class ShiftPlan:
    """A shift computed and checked, nothing changed yet (apply_shift makes it so)."""
    text: str         # the stream's canonical text after the shift
    head: int         # leading ids kept in place: the system prefix
    cut: int          # ids [head, cut) of the unshifted ids are dropped
    n_ids: int        # ids after the shift
    num_cached: int   # ids with K/V after the shift: in place, then moved
    moved: int        # ids whose K/V moves from id cut on to id head on
    dropped_chars: int

    @property
    def dropped(self) -> int:
        return self.cut - self.head


def folded_text(s: Stream, extra: str = "") -> str:
    """The stream's text once its pending reply (and `extra`) joins the canonical text."""
    return s.tok.text + s.pending + s.tail.decode("utf-8", errors="replace") + extra


def plan_shift(s: Stream, tokenizer: ReferenceTokenizer, text: str, *, room: int, max_context: int,
               gap: int | None = None, gap_at: int = 0) -> ShiftPlan:
    """Plan the shift of stream s whose canonical text is about to be `text` (folded_text), so
    that room more positions fit after it. gap: positions between the prefix's ids and the rest
    (a memory region's, about to be reserved after id gap_at; None: the region the stream
    holds, if any). Changes nothing; raises ContextFull when no shift can make that room."""
    if gap is None:
        gap, gap_at = (s.table.gap, s.region.gap_at) if s.region is not None else (0, 0)
    if s.tok.normalizes_nfc:
        text = unicodedata.normalize("NFC", text)
    ids = tokenizer.encode(text)
    n = len(ids)
    head, head_text = _head(s, tokenizer, text, ids, gap_at, max_context)
    need = n + room + gap - max_context          # ids to drop at least
    droppable = n - head
    if need > droppable - 1:
        raise _cannot(s.name, f"its system prefix holds {head} ids, its memory region {gap} positions "
                      f"and {n - head} more ids; with {room} more positions it cannot fit", max_context)
    first = head + min(max(need, droppable // 2), droppable - 1)
    turn = _turn_start(tokenizer, ids, first, n)
    for cut in ([turn] if turn is not None else []) + list(range(first, min(first + MAX_CUT_TRIES, n))):
        try:
            kept = tokenizer.decode_bytes(ids[cut:]).decode("utf-8")
        except UnicodeDecodeError:   # the cut splits a character
            continue
        new_text = head_text + kept
        if s.tok.normalizes_nfc and not unicodedata.is_normalized("NFC", new_text):
            continue
        if tokenizer.encode(new_text) == ids[:head] + ids[cut:]:
            break
    else:
        raise _cannot(s.name, f"no cut among ids {first}..{first + MAX_CUT_TRIES - 1} leaves a text "
                      "whose ids are the kept ones", max_context)
    # K/V is valid for the ids the old and new token lists share (and that were cached)
    valid = min(common(s.ids, ids), s.table.num_cached)
    moved = max(0, valid - cut) if valid >= head else 0
    return ShiftPlan(new_text, head, cut, head + n - cut, head + moved if valid >= head else valid,
                     moved, len(text) - len(new_text))


def _turn_start(tokenizer: ReferenceTokenizer, ids: list[int], first: int, n: int) -> int | None:
    """The first cut at or after `first` that starts a turn: at a special token (a chat
    template's <|im_start|>, <|start_header_id|>, ...) or after a newline, within the tokens a
    shift may drop (one is always kept). So the kept text begins with a whole turn, not with
    the tail of a reply; None: no such cut, the plain cut is used."""
    specials = set(tokenizer.special_tokens.values())
    for cut in range(first, min(n - 1, first + MAX_TURN_SCAN) + 1):
        if cut < n and ids[cut] in specials and ids[cut] not in tokenizer.eos_ids:
            return cut
    for cut in range(max(first, 1), min(n - 1, first + MAX_TURN_SCAN) + 1):
        if tokenizer.decode_bytes([ids[cut - 1]]).endswith(b"\n"):
            return cut
    return None


def apply_shift(s: Stream, plan: ShiftPlan, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
    """Make the plan so: move the kept K/V, release freed blocks, reset the tokenizer to the
    new text and fold the pending reply. Allocates no block (it only moves into held ones)."""
    table = s.table
    if plan.moved:
        move_kv(table, table.position(plan.cut), table.position(plan.head), plan.moved,
                cos_table, sin_table)
    table.truncate(plan.num_cached)      # num_cached <= the old one; blocks past it go back
    s.tok.reset(plan.text)               # one encode: the ids plan_shift checked
    s.generated.clear()
    s.pending, s.tail = "", b""


def move_kv(table: BlockTable, src: int, dst: int, n: int, cos_table: torch.Tensor,
            sin_table: torch.Tensor) -> None:
    """Move the K/V of positions src..src+n-1 to dst..dst+n-1 (dst < src): values unchanged, keys
    rotated by dst - src. cos/sin tables: fp32 (P, hd), P > src - dst (Decoder.rope_cos / _sin)."""
    if not 0 <= dst < src:
        raise ValueError(f"K/V moves to earlier positions only, got {src} -> {dst}")
    pool, bs = table.pool.tensor, table.pool.block_size
    dev = pool.device
    d = src - dst
    # the rotation by -d: cos(-x) = cos(x), sin(-x) = -sin(x); as a one-row table at position 0
    cos = cos_table[d:d + 1].to(dev)                                        # (1, hd)
    sin = -sin_table[d:d + 1].to(dev)
    by_token = pool.permute(0, 3, 1, 2, 4, 5)                               # (NB, bs, L, 2, KV, hd)
    blocks = torch.tensor(table.blocks, dtype=torch.long, device=dev)
    # ascending chunks: a chunk's destination ends before any later chunk's source starts
    for lo in range(0, n, MOVE_CHUNK):
        hi = min(n, lo + MOVE_CHUNK)
        pos = torch.arange(src + lo, src + hi, device=dev)
        part = by_token[blocks[pos // bs], pos % bs]                        # (T, L, 2, KV, hd), a copy
        rotate_scatter_tokens(pool, [part], torch.zeros(hi - lo, dtype=torch.long, device=dev),
                              table.slot_range(dst + lo, dst + hi), cos, sin)


def _head(s: Stream, tokenizer: ReferenceTokenizer, text: str, ids: list[int], gap_at: int,
          max_context: int) -> tuple[int, str]:
    """(ids, text) of the system prefix kept in place: the system text's own ids, or, when its
    last id joins the text after it, the fewest ids whose decode covers it."""
    if not s.system_chars:
        head, head_text = 0, ""
    else:
        system = text[:s.system_chars]
        system_ids = tokenizer.encode(system)
        p = common(system_ids, ids)
        if p == len(system_ids):
            head, head_text = p, system
        else:
            for q in range(p + 1, min(p + MAX_HEAD_TRIES, len(ids)) + 1):
                try:
                    h = tokenizer.decode_bytes(ids[:q]).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if len(h) >= len(system) and text.startswith(h):
                    head, head_text = q, h
                    break
            else:
                raise _cannot(s.name, "its system prefix's last id joins the text after it",
                              max_context)
    if head < gap_at:   # the region sits after id gap_at: the kept prefix must reach it
        raise _cannot(s.name, f"its memory region sits after id {gap_at}, inside its system prefix "
                      f"({head} ids)", max_context)
    return head, head_text


def _cannot(name: str, why: str, max_context: int) -> ContextFull:
    return ContextFull(f"stream {name!r} cannot shift to make room under max_context {max_context}: "
                       f"{why}; nothing changed (shorten the system prefix, generate fewer tokens, "
                       "lower MemoryConfig.region_tokens, or raise runtime.max_context)")
