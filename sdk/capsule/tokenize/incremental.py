"""Exact incremental tokenization: re-encode a short window at a provably stable boundary.

After every call ``ids == reference.encode(text)``. An edit keeps the ids before the latest old
piece boundary ``a`` that the family's rule proves stable (docs/TOKENIZATION.md), re-encodes
``text[a:]`` with the reference and splices. The state is the whole text and ids (older parts
frozen in chunks) plus piece boundaries (char offset, token count) of the last few KB only.
It is the one copy of a stream's canonical text and ids: read them with ``text_slice`` /
``ids_slice`` (what was asked for) or ``text`` / ``ids`` (the whole, O(n)).
"""
from __future__ import annotations

import os
import unicodedata
import weakref
from array import array
from typing import Any, Mapping

from . import incremental_state as state
from .frozen import Frozen, freeze_index
from .long_piece import LONG_MIN, Encoded, LongPieces
from .reference import load_reference
from .rules import rules_for
from .shadow import ShadowVerifier
from .splice import Admit, Splice, SpliceRule, common

TAIL_KEEP = 8192      # chars of boundary state kept behind the end (older text is frozen)
FREEZE_AT = 32768     # a tail this long is cut back towards TAIL_KEEP


class IncrementalTokenizer:
    """ids of a growing text, always equal to the reference tokenizer on the full text.

    Not thread-safe: one writer per instance (the shadow verifier only reads snapshots).
    """

    def __init__(self, reference: Any, *, shadow_rate: float = 0.01, seed: int | None = 0,
                 shadow_reference: Any = None) -> None:
        if not callable(getattr(reference, "encode", None)):
            raise TypeError("reference must be a ReferenceTokenizer (or have encode())")
        self._ref = reference
        self._rules, self.full_reason = rules_for(reference)
        self._rule_built: SpliceRule | None = None   # built on the first edit (a restore needs none)
        self._long: LongPieces | None = None
        self._full_mode = self._rules is None
        self._capsule = state.ChunkCache()
        me = weakref.ref(self)
        self._shadow = ShadowVerifier(shadow_reference if shadow_reference is not None
                                      else reference, reference.name, shadow_rate, seed,
                                      lambda: IncrementalTokenizer._diverged(me))
        self._stats = dict.fromkeys(("appends", "windows", "widenings", "fallbacks",
                                     "check_failures", "window_chars", "last_window",
                                     "long_pieces"), 0)
        self._clear()

    @classmethod
    def from_family(cls, name_or_path: str | os.PathLike[str], *, shadow_rate: float = 0.01,
                    seed: int | None = 0, **load_kwargs: Any) -> "IncrementalTokenizer":
        """An empty tokenizer over ``load_reference(name_or_path, **load_kwargs)``."""
        return cls(load_reference(name_or_path, **load_kwargs), shadow_rate=shadow_rate,
                   seed=seed)

    @property
    def normalizes_nfc(self) -> bool:
        """Whether the splice rule NFC-normalizes the text (text() is then the normalized text)."""
        return self._rules is not None and self._rules.nfc

    @staticmethod
    def _diverged(me: "weakref.ref[IncrementalTokenizer]") -> None:
        tok = me()
        if tok is not None:
            tok._full_mode = True
            tok.full_reason = "shadow verifier mismatch"

    def _clear(self) -> None:
        self._frozen = Frozen()     # the text and ids before the tail
        self._unchecked = False     # a restored tail not yet checked against the reference
        self._tail = ""
        self._tids: list[int] = []
        self._bpos, self._bcnt = [0], [0]
        if self._long is not None:
            self._long.seen = None

    @property
    def _rule(self) -> SpliceRule:
        if self._rule_built is None:
            assert self._rules is not None   # callers run only outside full mode
            self._rule_built = SpliceRule(self._ref, self._rules)
        return self._rule_built

    @property
    def reference(self) -> Any:
        return self._ref

    @property
    def full_mode(self) -> bool:
        """True when every call re-encodes the whole text (see ``full_reason``)."""
        return self._full_mode

    @property
    def check_pending(self) -> bool:
        """True while a restored tail awaits its check (``from_state(deferred=True)``)."""
        return self._unchecked

    @property
    def text(self) -> str:
        """The whole text (NFC-normalized for NFC families): O(n), unlike ``text_slice``."""
        return self.text_slice(0)

    @property
    def ids(self) -> list[int]:
        """A copy of the whole token list: O(n), unlike ``ids_slice`` and ``num_tokens``."""
        return self.ids_slice(0)

    @property
    def num_tokens(self) -> int:
        return self._frozen.tokens + len(self._tids)

    @property
    def num_chars(self) -> int:
        return self._frozen.chars + len(self._tail)

    def text_slice(self, lo: int, hi: int | None = None) -> str:
        """``text[lo:hi]`` (0 <= lo), costing what it returns (and a bisect)."""
        return self._frozen.text_slice(self._tail, lo, self.num_chars if hi is None else hi)

    def ids_slice(self, lo: int, hi: int | None = None) -> list[int]:
        """``ids[lo:hi]`` (0 <= lo), costing what it returns (and a bisect)."""
        return self._frozen.ids_slice(self._tids, lo, self.num_tokens if hi is None else hi)

    @property
    def stats(self) -> dict[str, int]:
        s = dict(self._stats)
        sh = self._shadow
        s.update(shadow_sampled=sh.sampled, shadow_checks=sh.checks,
                 shadow_mismatches=sh.mismatches, shadow_dropped=sh.dropped, shadow_errors=sh.errors,
                 full_mode=int(self._full_mode), boundaries=len(self._bpos))
        return s

    def flush_shadow(self, timeout: float | None = None) -> bool:
        """Wait for pending shadow checks (tests); False on timeout."""
        return self._shadow.flush(timeout)

    def append(self, text: str, admit: Admit = None) -> Splice:
        """Append text; the token list becomes ``ids[:keep] + splice.ids``. ``admit(n)`` is
        called with the new token count before anything changes: raising there refuses the
        append, leaving the text and ids as they were."""
        if not isinstance(text, str):
            raise TypeError(f"append() takes a str, not {type(text).__name__}")
        self._stats["appends"] += 1
        return self._edit(self.num_chars, text, admit)

    def replace_tail(self, n_chars: int, text: str) -> Splice:
        """Replace the last ``n_chars`` characters of ``self.text`` with ``text``."""
        n = self.num_chars
        if isinstance(n_chars, bool) or not isinstance(n_chars, int) or not 0 <= n_chars <= n:
            raise ValueError(f"n_chars must be an int in [0, {n}], not {n_chars!r}")
        if not isinstance(text, str):
            raise TypeError(f"replace_tail() takes a str, not {type(text).__name__}")
        return self._edit(n - n_chars, text)

    def reset(self, text: str = "") -> Splice:
        """Start over from ``text`` (one full encode)."""
        if not isinstance(text, str):
            raise TypeError(f"reset() takes a str, not {type(text).__name__}")
        return self._rebuild(text, count=False)

    def _edit(self, m0: int, new: str, admit: Admit = None) -> Splice:
        if self._unchecked and not self._settle():
            return self._rebuild(self.text_slice(0, m0) + new, admit=admit)
        base, tail, r = self._frozen.chars, self._tail, self._rules
        if self._full_mode or m0 < base or r is None:
            return self._rebuild(self.text_slice(0, m0) + new, admit=admit)
        rel = m0 - base
        if r.nfc:   # normalize from the last point where NFC cannot reach across
            z = tail[:rel] + new
            lo = rel
            while 0 < lo < len(z) and not self._rule.info.nfc_safe(z[lo - 1], z[lo]):
                lo -= 1
            if lo == 0 and base > 0:
                return self._rebuild(self.text_slice(0, m0) + new, admit=admit)
            t = z[:lo] + unicodedata.normalize("NFC", z[lo:])
        else:
            t, lo = tail[:rel] + new, rel
        m = common(tail, t, lo)   # text before m (tail-relative) is unchanged
        if m == len(t) == len(tail):
            if admit is not None:
                admit(self.num_tokens)
            return Splice(self.num_tokens, [])   # nothing changed (an empty append)
        i, widened = self._rule.choose(t, m, self._bpos, base, self._frozen.before, self._last_id)
        self._stats["widenings"] += widened
        if i is None:
            return self._rebuild(self.text_slice(0, base) + t, admit=admit)
        a = self._bpos[i] - base
        sp = self._long_window(t, a, m, i, admit) if len(t) - a >= LONG_MIN else None
        full = sp is None and a == 0 and base == 0 and bool(tail)
        if sp is None:
            sp = self._window(t, a, self._bcnt[i], i, admit)
        if full:
            self._stats["fallbacks"] += 1   # no later boundary qualified: a full encode
        if self._shadow.sample():
            self._shadow.submit((*self._frozen.chunks, self._tail),
                                (*self._frozen.chunk_ids, array("I", self._tids)), base + m)
        return sp

    def _window(self, t: str, a: int, cnt_a: int, i: int, admit: Admit) -> Splice:
        """Re-encode t[a:] (tail-relative a, token count cnt_a), splice, update boundaries."""
        w = t[a:]
        ids_w = self._ref.encode(w)
        if admit is not None:
            admit(cnt_a + len(ids_w))           # before any change: a refusal leaves no trace
        start = self._frozen.chars + a
        new_b, failed = self._rule.scan(w, ids_w, start, cnt_a)
        self._stats["check_failures"] += failed
        if self._long is not None:
            self._long.forget_from(start)
        return self._apply(t, i, cnt_a, ids_w, new_b, start, len(w))

    def _long_window(self, t: str, a: int, m: int, i: int, admit: Admit) -> Splice | None:
        """The window t[a:] through LongPieces when it holds one long piece; None otherwise."""
        if self._long is None:
            self._long = LongPieces(self._ref, self._rule.scanner)
        base = self._frozen.chars
        w = t[a:]
        enc: Encoded | None = self._long.encode(w, base + a, self._bcnt[i], self._tids,
                                                self._frozen.tokens)
        if enc is None:
            return None
        if admit is not None:
            admit(enc.total)
        new_b: list[tuple[int, int]] = []
        if enc.rest:
            rest = w[enc.end - base - a:]
            new_b, failed = self._rule.scan(rest, enc.rest, enc.end, enc.total - len(enc.rest))
            self._stats["check_failures"] += failed
        self._long.seen = enc.seen
        self._stats["long_pieces"] += 1
        return self._apply(t, i, enc.keep, enc.ids, enc.bounds + new_b, base + m, enc.redone)

    def _apply(self, t: str, i: int, keep: int, ids: list[int], new_b: list[tuple[int, int]],
               touched: int, redone: int) -> Splice:
        """Make ``t`` the tail, the first ``keep`` (absolute) old ids followed by ``ids`` its
        ids, and ``new_b`` its boundaries after boundary ``i``; ``touched``: the first absolute
        char that changed; ``redone``: chars encoded afresh (stats). The returned splice keeps
        the old ids that ``ids`` starts with too."""
        old = self._tids
        rel = keep - self._frozen.tokens
        extra = common(old[rel:], ids) if len(old) > rel else 0
        keep, ids = keep + extra, ids[extra:]
        del old[rel + extra:]
        old.extend(ids)
        self._capsule.touch(touched, keep)
        del self._bpos[i + 1:], self._bcnt[i + 1:]
        for pos, cnt in new_b:
            self._bpos.append(pos)
            self._bcnt.append(cnt)
        self._tail = t
        st = self._stats
        st["windows"] += 1
        st["window_chars"] += redone
        st["last_window"] = redone
        self._freeze()
        return Splice(keep, ids)

    def _rebuild(self, text: str, count: bool = True, admit: Admit = None) -> Splice:
        """Full reference encode of text; boundaries from a tail encode unless in full mode."""
        old, old_text = self.ids, self.text
        if self._rules is not None and self._rules.nfc:
            text = unicodedata.normalize("NFC", text)
        ids = self._ref.encode(text)
        if admit is not None:
            admit(len(ids))
        self._clear()
        self._tail, self._tids = text, list(ids)
        if count and old:
            self._stats["fallbacks"] += 1
        if not self._full_mode and self._rules is not None:
            self._scan_tail()
        keep = common(old, ids)
        self._capsule.touch(common(old_text, text), keep)
        self._freeze()
        return Splice(keep, list(ids[keep:]))

    def _settle(self) -> bool:
        """A restored state's first edit: are its tail ids the reference's (O(tail))? Then its
        boundaries are recomputed; False: the caller re-encodes the whole text (exact)."""
        if not (self._full_mode or self._rules is None):
            if list(self._ref.encode(self._tail)) != self._tids:
                return False     # still unchecked: a refused rebuild leaves it so (_clear clears)
            self._scan_tail()
        self._unchecked = False
        return True

    def _scan_tail(self) -> None:
        new_b, failed = self._rule.scan(self._tail, self._tids, self._frozen.chars, self._frozen.tokens)
        self._stats["check_failures"] += failed
        for pos, cnt in new_b:
            self._bpos.append(pos)
            self._bcnt.append(cnt)

    def _last_id(self, i: int) -> int:
        """The id of the token that ends at boundary i, -1 where it is frozen."""
        k = self._bcnt[i] - self._frozen.tokens
        return self._tids[k - 1] if k > 0 else -1

    def _freeze(self) -> None:
        """Move the tail's text and ids before a boundary into the frozen chunks once the tail
        is over FREEZE_AT chars (see ``freeze_index``)."""
        if len(self._tail) <= FREEZE_AT:
            return
        fz, bpos = self._frozen, self._bpos
        j = freeze_index(bpos, self.num_chars, TAIL_KEEP, FREEZE_AT,
                         lambda: self._rule.choose(self._tail, len(self._tail), bpos, fz.chars,
                                                   fz.before, self._last_id)[0])
        if j <= 0:
            return
        cut, ncut = bpos[j] - fz.chars, self._bcnt[j] - fz.tokens
        fz.push(self._tail[:cut], self._tids[:ncut])
        self._tail = self._tail[cut:]
        del self._tids[:ncut]
        del bpos[:j], self._bcnt[:j]

    def state_dict(self) -> tuple[dict, dict[str, bytes]]:
        """(JSON-able meta, named byte blobs): everything ``from_state`` needs; no pickle. The
        text and ids go out as chunks (incremental_state): only those an edit reached since
        the last call are serialized again."""
        meta = state.meta(self._ref, self.num_chars, self.num_tokens,
                          (self._frozen.chars, self._frozen.tokens),
                          self._full_mode, self._shadow.rate, self._stats)
        return meta, state.chunk_blobs(self.text_slice, self.ids_slice, self.num_chars,
                                       self.num_tokens, self._capsule)

    @classmethod
    def from_state(cls, tokenizer: Any, meta: Mapping[str, Any], blobs: Mapping[str, bytes], *,
                   verify: bool = False, shadow_rate: float | None = None,
                   deferred: bool = False) -> "IncrementalTokenizer":
        """Restore ``state_dict()`` output; ValueError on anything malformed or mismatched.

        The tail is re-checked against the reference (O(tail)); ``verify=True`` re-encodes the
        whole text too. ``deferred=True`` leaves the tail check to the first edit (a restore
        then needs no encoder); if it fails there, that edit re-encodes the whole text once.
        """
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_reference(tokenizer)
        saved = state.parse(tokenizer, meta, blobs, verify)
        tok = cls(tokenizer, shadow_rate=saved.shadow_rate if shadow_rate is None else shadow_rate)
        text, ids = saved.text, saved.ids
        if tok._rules is not None and tok._rules.nfc and not unicodedata.is_normalized("NFC", text):
            raise ValueError("tokenizer state text is not NFC-normalized, as this family's is")
        tok._stats.update(saved.stats)
        b0, c0 = (0, 0) if saved.full_mode or tok._full_mode else saved.base
        if b0:   # one frozen chunk before the tail's first boundary
            tok._frozen.push(text[:b0], ids[:c0])
        tok._tail, tok._tids = text[b0:], ids[c0:].tolist()
        tok._bpos, tok._bcnt, tok._capsule = [b0], [c0], saved.cache
        if saved.full_mode:
            tok._full_mode, tok.full_reason = True, "restored in full mode"
        elif deferred:
            tok._unchecked = not tok._full_mode
        elif not tok._settle():
            raise ValueError("tokenizer state ids differ from the reference on the text's tail")
        tok._freeze()
        return tok
