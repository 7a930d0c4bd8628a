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
from pathlib import Path
from typing import Any

try:   # declared dependency; without it every family re-encodes fully (still exact)
    import regex
except ImportError:   # pragma: no cover
    regex = None

from . import sources

# tiktoken-style patterns -> the letter class their runs need: "L" = \p{L} runs (marks are
# "other"), "LM" = [\p{L}\p{M}] runs (marks are letters).
CL100K = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"
          r"[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}"
          r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PATTERNS = {CL100K: "L", QWEN2: "L", QWEN35: "LM"}
CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_SPLITS = (r"\p{N}{1,3}", CJK,
                   "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                   "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                   "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
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
    """(rules, "") for a supported pipeline, else (None, why it re-encodes fully)."""
    specials = dict(ref.special_tokens)
    if regex is None:
        return None, "the regex package is not installed"
    if not ref.byte_level:
        return None, "not a byte-level BPE"
    if ref.pattern is not None:
        scheme = PATTERNS.get(ref.pattern)
        if scheme is None:
            return None, "pre-tokenizer pattern not in the verified set"
        norm = ref.normalization
        if norm not in (None, "NFC"):
            return None, f"normalization {norm}"
        pat = ref.pattern.replace(r"\s++$", r"\s++\Z")   # Rust's $ is the end of the text only
        return _make("regex", scheme == "LM", False, norm == "NFC", pat, specials, ()), ""
    meta = _json_header(ref)
    if meta is None:
        return None, "tokenizer.json header unreadable"
    norm = _normalizers(meta.get("normalizer"))
    if norm not in ([], ["NFC"]):
        return None, f"normalizer {norm}"
    added = meta.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None, "added tokens with lstrip/rstrip/single_word"
    first = [t["content"] for t in added if not t.get("normalized")]
    splits = _splits(meta.get("pre_tokenizer"))
    if splits is None:   # e.g. a plain ByteLevel (GPT-2 layout): exact, by full re-encoding
        return None, "pre-tokenizer not in the verified set"
    if splits == list(DEEPSEEK_SPLITS):
        return _make("spans", True, True, bool(norm), None, specials, first), ""
    if len(splits) == 1 and splits[0] in PATTERNS:
        return _make("spans", PATTERNS[splits[0]] == "LM", False, bool(norm), None, specials,
                     first), ""
    return None, "pre-tokenizer not in the verified set"


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
    name = ref.name
    if name.startswith("file:"):
        path: Path | None = Path(name[5:])
    else:
        files = sources.source_files(name)
        path = files[0] if files else None
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
