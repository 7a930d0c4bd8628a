"""Per-family rules of exact incremental tokenization: which old piece boundaries provably stay.

A family is incremental only when its pipeline is one whose look-ahead horizon
docs/TOKENIZATION.md bounds: a known pre-tokenizer pattern (or DeepSeek's three split stages),
no normalizer other than NFC, added tokens without lstrip/rstrip/single_word. Anything else
gets ``None`` and a reason: the incremental tokenizer then re-encodes fully (still exact).
"""
from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

try:   # declared dependency; without it every family re-encodes fully (still exact)
    import regex
except ImportError:   # pragma: no cover
    regex = None

from . import registry
from .patterns import CJK, VERIFIED, verified_key

WHITE_SPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                        "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_CAT = regex.compile(r"(\p{Cn}|\p{Cs})|(\p{L})|(\p{M})|(\p{N})") if regex else None
_CJK1 = regex.compile(CJK[:-1]) if regex else None
# Run classes: L letters, N digits, W white space, O other, K DeepSeek's CJK stage, ? unsure
# (unassigned in Python's or regex's Unicode tables: engines of other versions may differ).


@dataclass(frozen=True)
class Rules:
    """What the splice rule needs to know about one family's pipeline."""
    kind: str                     # "regex" (pieces by `pattern`) or "spans" (reference spans)
    marks_are_letters: bool
    cjk_stage: bool               # DeepSeek: CJK runs are isolated before the main split
    nfc: bool
    pattern: str | None           # python-regex form of a tiktoken pattern
    specials: dict[str, int]
    first_pass: frozenset[str]    # added tokens split out before the others (tokenizers)
    margin: int                   # max(4, longest special token)
    follow: frozenset[str]        # chars after a letter/digit inside some special token
    anchor_margin: bool           # some special token ends in a letter/digit: anchors need margin


def rules_for(ref: Any) -> tuple[Rules | None, str]:
    """(rules, "") for a supported pipeline, else (None, why it re-encodes fully).

    A registered family's pipeline must be the verified one its record names (``splice``); a
    tokenizer file's is looked up in the verified set.
    """
    if regex is None:
        return None, "the regex package is not installed"
    if not ref.byte_level:
        return None, "not a byte-level BPE"
    found = _pipeline(ref)
    if isinstance(found, str):
        return None, found
    kind, key, nfc, first = found
    fam = None if ref.name.startswith("file:") else registry.find_family(ref.name)
    if fam is not None and fam.splice != key:
        if fam.splice is None:
            return None, f"the {fam.name} record names no splice rule (splice=None)"
        return None, (f"{fam.name}'s pipeline is the verified {key!r}, not the {fam.splice!r} "
                      "its record names; fix the record's splice")
    v = VERIFIED[key]
    # Rust's $ is the end of the text only
    pattern = ref.pattern.replace(r"\s++$", r"\s++\Z") if kind == "regex" else None
    return _make(kind, v.marks_are_letters, v.cjk_stage, nfc, pattern, dict(ref.special_tokens),
                 first), ""


def _pipeline(ref: Any) -> tuple[str, str, bool, tuple[str, ...]] | str:
    """(kind, verified key, nfc, first-pass added tokens), or why the pipeline is unsupported."""
    if ref.pattern is not None:
        key = verified_key((ref.pattern,))
        if key is None:
            return "pre-tokenizer pattern not in the verified set"
        norm = ref.normalization
        if norm not in (None, "NFC"):
            return f"normalization {norm}"
        return "regex", key, norm == "NFC", ()
    meta = _json_header(ref)
    if meta is None:
        return "tokenizer.json header unreadable"
    norm = _normalizers(meta.get("normalizer"))
    if norm not in ([], ["NFC"]):
        return f"normalizer {norm}"
    added = meta.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return "added tokens with lstrip/rstrip/single_word"
    splits = _splits(meta.get("pre_tokenizer"))
    # None: e.g. a plain ByteLevel (GPT-2 layout): exact, by full re-encoding
    key = None if splits is None else verified_key(tuple(splits))
    if key is None:
        return "pre-tokenizer not in the verified set"
    return "spans", key, bool(norm), tuple(t["content"] for t in added if not t.get("normalized"))


def _make(kind: str, marks: bool, cjk: bool, nfc: bool, pattern: str | None,
          specials: dict[str, int], first: Any) -> Rules:
    info = CharInfo(marks, cjk)
    pairs = {s[i:i + 2] for s in specials for i in range(len(s) - 1)}
    follow = {p[1] for p in pairs if info.cls(p[0]) in "LNK" and info.cls(p[1]) != info.cls(p[0])}
    longest = max((len(s) for s in specials), default=0)
    ends = any(info.cls(s[-1]) in "LNK" for s in specials)
    return Rules(kind, marks, cjk, nfc, pattern, specials, frozenset(first), max(4, longest),
                 frozenset(follow), ends)


def _normalizers(spec: Any) -> list[str] | None:
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return None
    if spec.get("type") == "Sequence":
        out: list[str] = []
        for sub in spec.get("normalizers") or ():
            got = _normalizers(sub)
            if got is None:
                return None
            out += got
        return out
    return [str(spec.get("type"))]


def _splits(spec: Any) -> list[str] | None:
    """Regexes of a Sequence of isolated Splits ending in a plain ByteLevel, else None."""
    if not isinstance(spec, dict) or spec.get("type") != "Sequence":
        return None
    steps = spec.get("pretokenizers") or []
    if not steps or steps[-1] != {"type": "ByteLevel", "add_prefix_space": False,
                                  "trim_offsets": True, "use_regex": False}:
        return None
    out = []
    for s in steps[:-1]:
        pat = s.get("pattern") if isinstance(s, dict) else None
        if (s.get("type") != "Split" or s.get("behavior") != "Isolated" or s.get("invert")
                or not isinstance(pat, dict) or "Regex" not in pat):
            return None
        out.append(pat["Regex"])
    return out


def _json_header(ref: Any) -> dict | None:
    """added_tokens, normalizer and pre_tokenizer of a tokenizer.json, without its vocabulary."""
    path = registry.vocab_file(ref.name)
    if path is None:
        return None
    for size in (1 << 20, -1):   # these keys precede the vocabulary: try the first MB first
        try:
            with open(path, "rb") as f:
                text = f.read(size).decode("utf-8", "ignore" if size > 0 else "strict")
        except (OSError, UnicodeDecodeError):
            return None
        out = _header_keys(text)
        if out is not None:
            return out
    return None


def _header_keys(text: str) -> dict | None:
    end = text.find('"model"')
    dec, out = json.JSONDecoder(), {}
    for key in ("added_tokens", "normalizer", "pre_tokenizer"):
        at = text.find(f'"{key}"', 0, end if end > 0 else len(text))
        if at < 0:
            return None
        at = text.find(":", at) + 1
        while 0 < at < len(text) and text[at] in " \t\r\n":
            at += 1
        try:
            out[key] = dec.raw_decode(text, at)[0]
        except (ValueError, IndexError):
            return None
    return out


class CharInfo:
    """Run class and NFC safety of characters, memoized per tokenizer instance."""

    def __init__(self, marks_are_letters: bool, cjk_stage: bool) -> None:
        self._marks, self._cjk = marks_are_letters, cjk_stage
        self._memo: dict[str, str] = {chr(i): self._compute(chr(i)) for i in range(128)}
        self._safe: dict[str, bool] = {}

    def cls(self, c: str) -> str:
        k = self._memo.get(c)
        if k is None:
            if len(self._memo) > 65536:
                self._memo = {chr(i): self._memo[chr(i)] for i in range(128)}
            k = self._memo[c] = self._compute(c)
        return k

    def _compute(self, c: str) -> str:
        if self._cjk and _CJK1.match(c):
            return "K"
        if c in WHITE_SPACE:
            return "W"
        m = _CAT.match(c)
        if m is None:
            return "?" if unicodedata.category(c) == "Cn" else "O"
        if m.group(1) or unicodedata.category(c) in ("Cn", "Cs"):
            return "?"
        if m.group(2) or (m.group(3) and self._marks):
            return "L"
        return "N" if m.group(4) else "O"

    def nfc_safe(self, prev: str, c: str) -> bool:
        """True when NFC(X + prev + c + Y) == NFC(X + prev) + NFC(c + Y) for all X, Y.

        c must start with a starter that cannot compose with prev (a starter only ever composes
        with the starter right before it). Python's unicodedata is what the Qwen reference
        normalizes with, so these tables are the reference's own.
        """
        if c < "\x80":
            return True   # no ASCII char is the second half of a canonical composition
        key = prev + c
        got = self._safe.get(key)
        if got is None:
            d = unicodedata.normalize("NFD", c)
            got = (unicodedata.combining(d[0]) == 0
                   and unicodedata.normalize("NFC", key)
                   == unicodedata.normalize("NFC", prev) + unicodedata.normalize("NFC", c))
            if len(self._safe) > 65536:
                self._safe.clear()
            self._safe[key] = got
        return got
