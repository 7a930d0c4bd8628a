"""A GGUF's tokenizer fields read as untrusted input: every count, length, type and id checked.

``read_vocab(meta)`` turns the metadata (plain python values, keys as in the GGUF) into a
``GgufVocab``, or raises TokenizerError naming the field to fix. ``gguf_vocab`` builds the
tokenizer files from it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import TokenizerError

MAX_TOKENS = 1 << 21
MAX_MERGES = 1 << 22
MAX_TOKEN_CHARS = 4096       # real vocabularies top out at whitespace/code runs of a few hundred
MAX_TOTAL_CHARS = 1 << 26    # all tokens (or all merges) together
MAX_TEXT_CHARS = 1 << 20     # model, pre, chat template

K = "tokenizer.ggml."
# llama.cpp's token types (0 = undefined, read as normal)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
ID_FIELDS = ("bos", "eos", "eot", "unknown", "padding")


@dataclass(frozen=True)
class GgufVocab:
    """The checked tokenizer fields of one GGUF."""
    model: str                          # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None                     # tokenizer.ggml.pre
    architecture: str | None            # general.architecture
    tokens: Sequence[str]
    types: Sequence[int]                # one per token (NORMAL where the file has none)
    scores: Sequence[float] | None      # one per token
    merges: Sequence[tuple[str, str]] | None   # every part and its concatenation is a token
    ids: Mapping[str, int]              # of ID_FIELDS, those the file sets (all in range)
    add_bos: bool | None
    add_eos: bool | None
    add_space_prefix: bool | None
    chat_template: str | None


def fail(field: str, why: str) -> TokenizerError:
    return TokenizerError(f"GGUF tokenizer metadata: {field} {why}")


def _text(meta: Mapping[str, object], key: str, required: bool = False) -> str | None:
    v = meta.get(key)
    if v is None:
        if required:
            raise fail(key, "is missing")
        return None
    if not isinstance(v, str):
        raise fail(key, f"must be a string, not {type(v).__name__}")
    if len(v) > MAX_TEXT_CHARS:
        raise fail(key, f"has {len(v)} characters; at most {MAX_TEXT_CHARS} are allowed")
    _utf8(key, v)
    return v


def _utf8(field: str, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:   # lone surrogates cannot be written to a tokenizer.json
        raise fail(field, f"is not valid Unicode ({exc.reason})") from exc


def _flag(meta: Mapping[str, object], key: str) -> bool | None:
    v = meta.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise fail(key, f"must be a bool, not {type(v).__name__}")


def _list(meta: Mapping[str, object], key: str, limit: int) -> list | None:
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)):
        raise fail(key, f"must be a list, not {type(v).__name__}")
    if len(v) > limit:
        raise fail(key, f"has {len(v)} entries; at most {limit} are allowed")
    return list(v)


def _strings(key: str, items: list, max_len: int) -> list[str]:
    if not all(type(s) is str for s in items):
        i = next(i for i, s in enumerate(items) if not isinstance(s, str))
        raise fail(f"{key}[{i}]", f"must be a string, not {type(items[i]).__name__}")
    if items and max(map(len, items)) > max_len:
        i = next(i for i, s in enumerate(items) if len(s) > max_len)
        raise fail(f"{key}[{i}]", f"has {len(items[i])} characters; at most {max_len} are "
                   "allowed")
    total = sum(map(len, items))
    if total > MAX_TOTAL_CHARS:
        raise fail(key, f"holds {total} characters; at most {MAX_TOTAL_CHARS} are allowed")
    try:
        "".join(items).encode("utf-8")
    except UnicodeEncodeError:
        bad = next(i for i, s in enumerate(items) if not _encodes(s))
        raise fail(f"{key}[{bad}]", "is not valid Unicode (a lone surrogate)") from None
    return items


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(v: object) -> bool:
    # numpy integers count too; bools do not
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _same_length(key: str, items: list | None, n: int) -> None:
    if items is not None and len(items) != n:
        raise fail(key, f"has {len(items)} entries but tokenizer.ggml.tokens has {n}")


def read_vocab(meta: Mapping[str, object]) -> GgufVocab:
    """The tokenizer fields of ``meta``, checked (TokenizerError names the bad field)."""
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping of GGUF keys to values, not "
                        f"{type(meta).__name__}")
    model = _text(meta, K + "model", required=True)
    raw = _list(meta, K + "tokens", MAX_TOKENS)
    if not raw:
        raise fail(K + "tokens", "is missing or empty")
    tokens = _strings(K + "tokens", raw, MAX_TOKEN_CHARS)
    n = len(tokens)

    types = _list(meta, K + "token_type", MAX_TOKENS)
    _same_length(K + "token_type", types, n)
    if types and not (all(type(t) is int for t in types) and 0 <= min(types)
                      and max(types) <= BYTE):
        for i, t in enumerate(types):
            if not _is_int(t) or not 0 <= t <= BYTE:
                raise fail(f"{K}token_type[{i}]", f"is {t!r}; token types are ints 0..6")

    scores = _list(meta, K + "scores", MAX_TOKENS)
    _same_length(K + "scores", scores, n)
    for i, s in enumerate(scores or ()):
        if not (type(s) is float or (isinstance(s, numbers.Real) and not isinstance(s, bool))
                ) or math.isnan(s):
            raise fail(f"{K}scores[{i}]", f"is {s!r}; scores are numbers (not NaN)")

    ids: dict[str, int] = {}
    for name in ID_FIELDS:
        key = f"{K}{name}_token_id"
        v = meta.get(key)
        if v is None:
            continue
        if not _is_int(v) or not 0 <= v < n:
            raise fail(key, f"is {v!r}; ids are ints in [0, {n}) (the number of tokens)")
        ids[name] = int(v)

    raw_merges = _list(meta, K + "merges", MAX_MERGES)
    merges = None
    if raw_merges is not None:
        merges = parse_merges(_strings(K + "merges", raw_merges, 2 * MAX_TOKEN_CHARS + 1),
                              set(tokens))
    return GgufVocab(
        model=str(model), pre=_text(meta, K + "pre"),
        architecture=_text(meta, "general.architecture"), tokens=tokens,
        types=[int(t) for t in types] if types is not None else [NORMAL] * n,
        scores=[float(s) for s in scores] if scores is not None else None, merges=merges,
        ids=ids, add_bos=_flag(meta, K + "add_bos_token"),
        add_eos=_flag(meta, K + "add_eos_token"),
        add_space_prefix=_flag(meta, K + "add_space_prefix"),
        chat_template=_text(meta, "tokenizer.chat_template"))


def parse_merges(items: list[str], vocab: set[str]) -> list[tuple[str, str]]:
    """"a b" entries as pairs; both parts and their concatenation must be tokens (as BPE needs)."""
    out = []
    for i, m in enumerate(items):
        a, _, b = m.partition(" ")
        if not a or not b or " " in b:
            raise fail(f"{K}merges[{i}]", f"is {m[:80]!r}; a merge is two tokens joined by "
                       "one space")
        if a not in vocab or b not in vocab or a + b not in vocab:
            piece = next(p for p in (a, b, a + b) if p not in vocab)
            raise fail(f"{K}merges[{i}]", f"({m[:80]!r}) names {piece[:80]!r}, which is "
                       "not in tokenizer.ggml.tokens")
        out.append((a, b))
    return out
