"""Engine: streams of tokens over one decoder, prefilled on demand and decoded together.

A stream's token ids are the reference tokenizer's ids of its text (held by its incremental
tokenizer, the one copy), followed by whatever the model generated since the last append.
K/V is cached for ids[:table.num_cached]. An append costs the window the tokenizer re-encodes,
never the history. Not thread-safe: the Session serializes calls.

A stream that would pass max_context follows the context policy (context_shift.py): "error"
raises ContextFull with nothing changed; "shift" drops the stream's oldest non-system tokens
first (the kept K/V are rotated copies, not a fresh prefill: see context_shift.py).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from edge_kernels.rope import check_reinjectable

from ..errors import ContextFull, UnknownStream
from ..tokenize import IncrementalTokenizer, ReferenceTokenizer
from ..tokenize.splice import common
from ..tokenize.utf8 import split_incomplete
from .choices import Choices
from .context_shift import ShiftPlan, apply_shift, check_policy, folded_text, full_error, plan_shift
from .kv_pool import KVPool
from .region import fill, reserve, span, zero_covered
from .runner import DecodeRow, GraphRunner
from .sampler import SamplingParams, sample_decodable, stream_generator
from .replies import OnToken, ReplyPieces, cut_at_stop
from .streams import Stream, check_stream_name


MAX_QUERY_CHARS = 2000   # of the user's turn, kept as the memory query (capsule state)
log = logging.getLogger("capsule")


class Engine:
    """Append text, generate tokens; owns the streams, shares the pool and runner."""

    def __init__(self, runner: GraphRunner, pool: KVPool, tokenizer: ReferenceTokenizer,
                 context_policy: str = "error"):
        self.runner, self.pool, self.tokenizer = runner, pool, tokenizer
        self.streams: dict[str, Stream] = {}
        self.context_policy = check_policy(context_policy)
        if context_policy == "shift":   # kept keys are re-rotated: the rotation must be p-only
            check_reinjectable(runner.model.cfg.rope)
        # context shifts per stream done by this engine, and the last one (process stats, not
        # capsule state)
        self.shifts: dict[str, int] = {}
        self.last_shift: ShiftPlan | None = None

    def stream(self, name: str) -> Stream:
        check_stream_name(name)
        if name not in self.streams:
            raise UnknownStream(f"no stream {name!r}; streams: {', '.join(self.streams) or 'none yet'} "
                           "(append text to create one)")
        return self.streams[name]

    def append(self, name: str, text: str, system: bool = False) -> None:
        """Add text. The stream's ids become the reference ids of its whole text, computed by
        the exact incremental tokenizer (a window around the seam); the K/V of the unchanged
        id prefix is kept. A rejected append leaves no trace.

        system=True extends the system prefix, which must come before any other text: a memory
        region, when the stream gets one, sits right after it.
        """
        check_stream_name(name)
        if not isinstance(text, str):
            raise ValueError(f"append takes str, got {type(text).__name__}")
        s = self.streams.get(name) or Stream.new(name, self.pool, IncrementalTokenizer(self.tokenizer))
        if system and (s.system_chars != s.n_chars or s.region is not None):
            raise ValueError(f"stream {name!r} already holds conversation text or memory; system "
                             "text goes first (append it before anything else)")
        max_context = self.runner.max_context

        def admit(n: int) -> None:   # the tokenizer asks before it changes anything
            if s.table.slot_end(n) > max_context:
                raise full_error(name, f"would span {s.table.slot_end(n)} positions", max_context)
        canonical = s.tok.num_tokens
        generated_since = bool(s.pending or s.tail)
        # a reply that ended inside a character: its bytes join the text now, as U+FFFD; the
        # generated text joins the canonical text here, re-tokenized with the rest
        folded = s.pending + s.tail.decode("utf-8", errors="replace") + text
        try:
            sp = s.tok.append(folded, admit)
        except ContextFull:
            if self.context_policy != "shift":
                raise
            if system:   # a shift keeps the system prefix whole: it cannot make room for it
                raise ContextFull(f"stream {name!r}: its system prefix would not fit max_context "
                                  f"{max_context}; shorten it or raise runtime.max_context") from None
            # the appended text is in the shifted one
            self._apply_shift(s, self._plan_shift(s, s.tok.text + folded, 0))
        else:
            # the K/V holds (old canonical ids + generated); the ids are now old[:keep] + sp.ids,
            # keep as large as possible: past the old canonical ids only if the generated ones match
            keep = sp.keep
            if keep == canonical and s.generated:
                keep += common(s.generated, sp.ids)
            s.table.truncate(keep)          # a re-tokenized seam invalidates the K/V after it
        self.streams[name] = s
        s.generated.clear()
        s.pending, s.tail = "", b""
        if system:
            s.system_chars = s.tok.num_chars
        else:
            # the user's turn: everything appended since the model last spoke (its reply was
            # pending until this append), e.g. "user: where is it?\n" then "assistant:"
            turn = text if generated_since else s.last_user + text
            s.last_user = turn[-MAX_QUERY_CHARS:]

    def memory_room(self, name: str, region_tokens: int, max_new_tokens: int) -> tuple[int, int]:
        """(positions the stream's region holds, pool blocks the stream needs beyond those it
        holds to reserve and fill its region, re-prefill and generate max_new_tokens): raises
        ValueError if the stream is empty, ContextFull if it would not fit max_context, with
        nothing changed. Under the "shift" policy a stream that would not fit is shifted first."""
        s = self.stream(name)
        size, end, gap, gap_at = self._region_room(s, region_tokens)
        if end + max_new_tokens > self.runner.max_context:
            if self.context_policy != "shift":
                raise full_error(name, f"spans {end} positions with its memory region; {max_new_tokens} "
                                 "more would exceed max_context", self.runner.max_context,
                                 "generate fewer tokens, lower MemoryConfig.region_tokens")
            self._apply_shift(s, self._plan_shift(s, folded_text(s), max_new_tokens, gap, gap_at))
            size, end, _, _ = self._region_room(s, region_tokens)
        return size, -(-(end + max_new_tokens) // self.pool.block_size) - len(s.table.blocks)

    def drop(self, name: str) -> None:
        """Forget a stream: its text, ids and K/V blocks (back to the pool)."""
        s = self.stream(name)
        del self.streams[name]
        self.pool.release(s.table.blocks)

    def fill_memory(self, name: str, facts: Sequence[tuple[int, torch.Tensor]],
                    region_tokens: int, key_scales: Sequence[float] | None = None) -> bool:
        """Make the stream's memory region hold exactly these facts (id, kv), in order, the last
        right before the rest; kv is token-major (T, L, 2, KV, hd) pre-RoPE keys and values
        (FactKV.kv); key_scales: one per fact, what its keys are multiplied by (region.fill).

        The region (region_tokens positions, block-aligned) is reserved on first use right
        after the system prefix; the K/V of tokens after it is recomputed once then, and never
        again when the facts change. Returns True when the region's content changed.
        """
        s = self.stream(name)
        if s.region is not None and s.region.fact_ids == tuple(f for f, _ in facts):
            return False
        if s.region is not None:
            fill(s.table, s.region, self.runner.model, facts, key_scales)
            return True
        gap_at, _, _ = self._plan_region(s, region_tokens)         # the checks, before any change
        check_reinjectable(self.runner.model.cfg.rope)
        covered = sum(kv.shape[0] for _, kv in facts)
        s.region = reserve(s.table, gap_at, region_tokens, covered)
        try:
            fill(s.table, s.region, self.runner.model, facts, key_scales)
        except BaseException:
            zero_covered(s.table, s.region, covered)   # never leave unwritten garbage readable
            raise
        return True

    def _region_room(self, s: Stream, region_tokens: int) -> tuple[int, int, int, int]:
        """(region size, positions the stream spans, positions its ids after the prefix sit
        behind, the prefix's ids) with its region, held or reserved now, right after the system
        prefix's ids; ValueError if the stream is empty."""
        if not s.n_ids:
            raise ValueError(f"stream {s.name!r} is empty; append text before generating")
        if s.region is not None:
            return s.region.size, s.table.slot_end(s.n_ids), s.table.gap, s.region.gap_at
        gap_at = 0
        if s.system_chars:
            system_ids = self.tokenizer.encode(s.tok.text_slice(0, s.system_chars))
            gap_at = common(system_ids, s.ids_slice(0, len(system_ids)))
        start, size = span(gap_at, region_tokens, self.pool.block_size)
        return size, start + size + s.n_ids - gap_at, start + size - gap_at, gap_at

    def _plan_region(self, s: Stream, region_tokens: int) -> tuple[int, int, int]:
        """(gap_at, size, positions the stream spans then) of a region reserved now;
        ContextFull if the stream could not hold it."""
        size, end, _, gap_at = self._region_room(s, region_tokens)
        if end > self.runner.max_context:
            raise full_error(s.name, f"with a {region_tokens}-token memory region would span {end} "
                             "positions", self.runner.max_context, "lower MemoryConfig.region_tokens")
        return gap_at, size, end

    def _plan_shift(self, s: Stream, text: str, room: int, gap: int | None = None,
                    gap_at: int = 0) -> ShiftPlan:
        return plan_shift(s, self.tokenizer, text, room=room, gap=gap, gap_at=gap_at,
                          max_context=self.runner.max_context)

    def _apply_shift(self, s: Stream, plan: ShiftPlan) -> None:
        model = self.runner.model
        apply_shift(s, plan, model.rope_cos, model.rope_sin)
        if s.chat is not None:   # the chat's start moves with the text; its first turns are gone
            start = s.chat.start
            if start > s.system_chars:
                start = max(s.system_chars, start - plan.dropped_chars)
            s.chat = dataclasses.replace(s.chat, start=start, exact=False)
        self.shifts[s.name] = self.shifts.get(s.name, 0) + 1
        self.last_shift = plan
        log.info("stream %r: context shift dropped %d ids (%d chars), kept %d (K/V of %d moved)",
                 s.name, plan.dropped, plan.dropped_chars, plan.n_ids, plan.moved)

    def generate(self, names: Sequence[str], max_new_tokens: int, params: SamplingParams,
                 seed: int | None, stop: Sequence[str], on_token: OnToken | None = None,
                 choices: Sequence[str] | None = None) -> dict[str, str]:
        """Generate up to max_new_tokens for each stream, decoding all of them in one batch per step.

        on_token(name, piece), called on this thread as the replies grow: each stream's pieces,
        in order, join to exactly its returned reply (see ReplyPieces). If it raises, decoding stops,
        the streams keep what was generated (ids and text together) and the error propagates.
        choices: the reply is exactly one of them (one stream only; see llm/choices.py).
        """
        trie = None
        if choices is not None:
            trie = Choices(self.tokenizer, choices)
            if len(names) != 1:
                raise ValueError(f"choices constrain one stream's reply, got streams {list(names)}")
            if trie.max_tokens > max_new_tokens:
                raise ValueError(f"the longest choice is {trie.max_tokens} tokens; max_new_tokens "
                                 f"{max_new_tokens} cannot spell it (raise it)")
        streams = [self.stream(n) for n in names]
        shifts = []
        for s in streams:  # validate (and plan every shift) before touching any generator
            if not s.n_ids:
                raise ValueError(f"stream {s.name!r} is empty; append text before generating")
            if s.table.slot_end(s.n_ids + max_new_tokens) > self.runner.max_context:
                if self.context_policy != "shift":
                    raise full_error(s.name, f"spans {s.table.slot_end(s.n_ids)} positions; {max_new_tokens} "
                                     "more would exceed max_context", self.runner.max_context)
                shifts.append((s, self._plan_shift(s, folded_text(s), max_new_tokens)))
        for s, plan in shifts:
            self._apply_shift(s, plan)
        for s in streams:
            s.generator = stream_generator(s.generator, params, seed, self.pool.tensor.device)
        # a character the last reply ended inside is completed by this one (s.tail)
        out = {s.name: bytearray(s.tail) for s in streams}
        eos = set(self.tokenizer.eos_ids)
        texts: dict[str, str] = {}
        pieces = ReplyPieces(on_token, stop) if on_token is not None else None
        try:
            self._generate_loop(streams, out, max_new_tokens, params, [x.encode() for x in stop], eos,
                                pieces, trie)
        finally:
            # ids and text move together even when a step fails midway; the generated text
            # reaches the incremental tokenizer with the next append
            for s in streams:
                complete, s.tail = split_incomplete(bytes(out[s.name]))
                texts[s.name] = piece = complete.decode("utf-8", errors="replace")
                s.pending += piece
        # a session restored from a capsule has not needed the encoder yet: build it while the
        # robot acts on this reply, so the next append does not pay for it
        self.tokenizer.prefetch()
        replies = {s.name: cut_at_stop(texts[s.name], stop, self.tokenizer, s.last_id in eos) for s in streams}
        for s in streams if pieces is not None else ():
            pieces.finish(s.name, replies[s.name])   # what was held until the reply ended
        return replies

    def _generate_loop(self, streams: list[Stream], out: dict[str, bytearray], max_new_tokens: int,
                       params: SamplingParams, stops: list[bytes], eos: set[int],
                       pieces: "ReplyPieces | None", trie: Choices | None = None) -> None:
        logits = torch.stack([self._prefill_pending(s) for s in streams])          # (n, V)
        active = list(streams)
        start = len(streams[0].generated)
        for step in range(max_new_tokens):
            if trie is not None:        # one stream: only ids that continue a choice
                trie.mask(logits[0], streams[0].generated[start:])
            picks = sample_decodable(self.runner.sampler, self.tokenizer, logits, params,
                                     [s.generator for s in active])
            still = []
            for s, (tok, piece) in zip(active, picks):
                s.generated.append(tok)      # joins the canonical ids with the next append
                out[s.name] += piece
                # a stop string can only newly appear in the tail that this token touched
                tail = out[s.name][-(len(piece) + max((len(x) for x in stops), default=0)):]
                done = tok in eos or any(x in tail for x in stops) or (
                    trie is not None and trie.done(s.generated[start:]))
                if not done and step + 1 < max_new_tokens:
                    still.append(s)
            active = still
            for s in still if pieces is not None else ():
                pieces.step(s.name, out[s.name])   # a reply that ended is handed out by finish
            if not active:
                break
            logits = self.runner.decode([self.next_row(s) for s in active])

    def _prefill_pending(self, s: Stream) -> torch.Tensor:
        """Logits after the stream's last token, computing K/V for the uncached ids."""
        n = s.n_ids
        if s.table.num_cached >= n:
            s.table.truncate(n - 1)  # recompute the last token to get its logits
        return self.runner.prefill(s.ids_slice(s.table.num_cached), s.table)

    def next_row(self, s: Stream) -> DecodeRow:
        """The decode row of the stream's next step (its last id, at the next position); the
        stream counts that position as cached from now on (the step writes its K/V)."""
        i = s.n_ids - 1
        s.table.ensure_capacity(i + 1)
        row = DecodeRow(s.last_id, s.table.position(i), s.table.slots(i, i + 1)[0],
                        tuple(s.table.blocks), s.table.skip)
        s.table.num_cached = i + 1
        return row
