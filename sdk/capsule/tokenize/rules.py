"""Per-family rules of exact incremental tokenization: which old piece boundaries provably stay.

A family is incremental only when its pipeline is one whose look-ahead horizon
docs/TOKENIZATION.md bounds: a verified pre-tokenizer (``patterns.VERIFIED``), no normalizer
other than NFC, added tokens without lstrip/rstrip/single_word. Anything else gets ``None`` and
a reason: the incremental tokenizer then re-encodes fully (still exact).
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
from .patterns import (CJK, COVER_ALL, DIGIT_RUNS, DIGITS, FALCON_SPLITS, GPT2, PUNCT, VERIFIED,
                       Verified, verified_key)

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
    scheme: str = "runs"          # run classes of the proof: "runs" or "cased" (patterns.py)
    digit_step: int = 0           # digit pieces of fixed length (Rule 3); 0: one per digit run
    space_runs: bool = False      # long space / tab runs may be cut before pre-tokenizing
    digit_runs: bool = False      # ... and a long trailing ASCII digit run

    @property
    def whole_chars(self) -> bool:
        """Whether the pipeline's pieces are whole characters. False for Falcon ("punct"),
        whose stages after ByteLevel may cut a character's byte symbols apart."""
        return self.scheme != "punct"


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
    pattern = python_pattern(ref.pattern) if kind == "regex" else None
    return _make(kind, v, nfc, pattern, dict(ref.special_tokens), first), ""


def python_pattern(pattern: str) -> str:
    """A tiktoken pattern as the ``regex`` package must spell it: Rust's ``$`` is the end of the
    text only."""
    return pattern.replace(r"\s++$", r"\s++\Z")


def pipeline_key(ref: Any) -> str | None:
    """The key in ``VERIFIED`` that a tokenizer's pipeline equals, else None."""
    found = _pipeline(ref)
    return None if isinstance(found, str) else found[1]


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
    try:
        meta = json.loads(ref.pipeline) if ref.pipeline else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        return "no tokenizer.json pipeline to check"
    norm = _normalizers(meta.get("normalizer"))
    if norm not in ([], ["NFC"]):
        return f"normalizer {norm}"
    added = [t for t in meta.get("added_tokens") or () if isinstance(t, dict)]
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return "added tokens with lstrip/rstrip/single_word"
    found = _splits(meta.get("pre_tokenizer"))
    key = None if found is None else verified_key(found[0])
    if key is None:
        return "pre-tokenizer not in the verified set"
    if found[1] and key not in COVER_ALL:   # type: ignore[index]
        return "a Split that drops unmatched text (Removed/invert) with a pattern that has gaps"
    return "spans", key, bool(norm), tuple(t["content"] for t in added if not t.get("normalized"))


def _make(kind: str, v: Verified, nfc: bool, pattern: str | None, specials: dict[str, int],
          first: Any) -> Rules:
    info = CharInfo(v.marks_are_letters, v.cjk_stage, v.scheme)
    pairs = {s[i:i + 2] for s in specials for i in range(len(s) - 1)}
    # chars that may follow a provable boundary inside some special token (Rules 1 and 3)
    follow = {p[1] for p in pairs if info.anchor(p[0], p[1])
              or (v.digit_step and info.cls(p[0]) == info.cls(p[1]) == info.digit)}
    longest = max((len(s) for s in specials), default=0)
    ends = any(info.may_end_anchor(s[-1]) for s in specials)
    return Rules(kind, v.marks_are_letters, v.cjk_stage, nfc, pattern, specials, frozenset(first),
                 max(4, longest), frozenset(follow), ends, v.scheme, v.digit_step, v.space_runs,
                 v.digit_runs)


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


def _splits(spec: Any) -> tuple[tuple[str, ...], bool] | None:
    """(stages, whether a stage drops gaps) of a verifiable pre-tokenizer, else None.

    Verifiable: isolated Splits (or Removed + invert: matches kept, gaps dropped), Digits and
    Punctuation(contiguous) stages, and one ByteLevel without a prefix space, whose GPT-2 regex
    is a stage of its own where it stands when ``use_regex``. It is the last stage, except in
    Falcon's layout (``FALCON_SPLITS``), the only verified one with stages after it.
    """
    if not isinstance(spec, dict):
        return None
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        return None
    levels = [i for i, s in enumerate(steps) if s.get("type") == "ByteLevel"]
    if len(levels) != 1 or steps[levels[0]].get("add_prefix_space") is not False:
        return None
    out, drops = [], False
    for s in steps:
        kind = s.get("type")
        if kind == "ByteLevel":
            if s.get("use_regex", True):
                out.append(GPT2)
            continue
        if kind == "Digits" and isinstance(s.get("individual_digits"), bool):
            out.append(DIGITS if s["individual_digits"] else DIGIT_RUNS)
            continue
        if kind == "Punctuation" and s.get("behavior") == "Contiguous":
            out.append(PUNCT)
            continue
        pat = s.get("pattern")
        if kind != "Split" or not isinstance(pat, dict) or "Regex" not in pat:
            return None
        if (s.get("behavior"), bool(s.get("invert"))) == ("Removed", True):
            drops = True
        elif (s.get("behavior"), bool(s.get("invert"))) != ("Isolated", False):
            return None
        out.append(pat["Regex"])
    if levels[0] != len(steps) - 1 and tuple(out) != FALCON_SPLITS:
        return None
    return tuple(out), drops


# tokenizers' is_punctuation: ASCII punctuation, or a P* category
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_GROUP = {"L": "X", "M": "X", "O": "X", "S": "X", "W": "W", "R": "W", "N": "N"}


class CharInfo:
    """Run class, anchors and NFC safety of characters, memoized per tokenizer instance.

    Scheme "runs" (classes L N W O, K for DeepSeek's CJK stage): a class change is any change
    between certain classes. Scheme "cased" (o200k, tekken), whose letter and other runs share
    the marks and whose ``[\\r\\n/]*`` tail mixes newlines and '/': classes L M N W O, R for
    \\r \\n, S for '/'; a change counts between the groups {L M O S}, {W R} and {N}, except R-S.
    """

    def __init__(self, marks_are_letters: bool, cjk_stage: bool, scheme: str = "runs") -> None:
        if scheme not in ("runs", "cased", "isolated", "punct"):
            raise ValueError(f"unknown run-class scheme {scheme!r}")
        self._marks, self._cjk, self._scheme = marks_are_letters, cjk_stage, scheme
        self._cased = scheme == "cased"
        # the class of the digits that Rule 3 groups: Falcon's groups are ASCII [0-9]{3}
        self.digit = "D" if scheme == "punct" else "N"
        self._memo: dict[str, str] = {chr(i): self._compute(chr(i)) for i in range(128)}
        self._safe: dict[str, bool] = {}

    def cls(self, c: str) -> str:
        k = self._memo.get(c)
        if k is None:
            if len(self._memo) > 65536:
                self._memo = {chr(i): self._memo[chr(i)] for i in range(128)}
            k = self._memo[c] = self._compute(c)
        return k

    def change(self, left: str, right: str) -> bool:
        """Whether classes ``left`` then ``right`` make a class change the run rule counts."""
        if left == right or left == "?" or right == "?" or self._scheme in ("isolated", "punct"):
            return False   # "isolated", "punct": no run rule, only anchors
        if self._cased:
            return _GROUP[left] != _GROUP[right] and {left, right} != {"R", "S"}
        return True

    def anchor(self, prev: str, c: str) -> bool:
        """Whether a piece provably ends between chars ``prev`` and ``c`` (Rule 1)."""
        k0, k1 = self.cls(prev), self.cls(c)
        if self._scheme == "isolated":   # every newline and digit is a piece of its own
            return "?" not in (k0, k1) and ("R" in (k0, k1) or "N" in (k0, k1))
        if self._scheme == "punct":   # the edge of an ASCII punctuation run or digit run
            if "?" in (k0, k1):
                return False
            # a run edge whose run side is ASCII (the same class in every Unicode version)
            punct = (k0 in "PQ") != (k1 in "PQ") and "P" in (k0, k1)
            digit = (k0 in "DN") != (k1 in "DN") and "D" in (k0, k1)
            return punct or digit
        if k1 == "?" or k1 == k0:
            return False
        if self._cased:   # a letter run may go on with marks or a contraction ("don't")
            return k0 == "N" or (k0 == "L" and k1 != "M" and c != "'")
        return k0 in "LNK"

    def may_end_anchor(self, c: str) -> bool:
        """Whether a special token ending in ``c`` could end right before an anchor."""
        return self._scheme in ("isolated", "punct") or self.cls(c) in "LNK"

    def _compute(self, c: str) -> str:
        if self._cjk and _CJK1.match(c):
            return "K"
        if self._cased and c in "\r\n/":
            return "S" if c == "/" else "R"
        if self._scheme == "isolated" and c in "\r\n":
            return "R"
        if self._scheme == "punct":
            return self._punct_class(c)
        if c in WHITE_SPACE:
            return "W"
        m = _CAT.match(c)
        if m is None:
            return "?" if unicodedata.category(c) == "Cn" else "O"
        if m.group(1) or unicodedata.category(c) in ("Cn", "Cs"):
            return "?"
        if self._scheme == "isolated":
            return "N" if m.group(4) else "X"
        if m.group(2):
            return "L"
        if m.group(3):
            return "M" if self._cased else "L" if self._marks else "O"
        return "N" if m.group(4) else "O"

    @staticmethod
    def _punct_class(c: str) -> str:
        """Falcon's classes: P ASCII punctuation, D ASCII digit (certain in every Unicode
        version), Q other punctuation, N other numeric, X the rest, ? unassigned here."""
        if c < "\x80":
            return "P" if c in _ASCII_PUNCT else "D" if "0" <= c <= "9" else "X"
        cat = unicodedata.category(c)
        if cat in ("Cn", "Cs", "Co"):
            return "?"
        return "Q" if cat[0] == "P" else "N" if cat[0] == "N" else "X"

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
