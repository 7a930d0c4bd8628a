"""Reference tokenizers: the exact ids that every faster tokenizer path in capsule must reproduce.

``load_reference("qwen2.5")`` gives one shared, immutable ``ReferenceTokenizer`` per vocabulary
and process; its ``encode`` is the family's own reference encoder on the full text.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence

from ..errors import TokenizerError
from . import families
from .families import Parts

FAMILIES = ("cl100k_base", "qwen2.5", "qwen3.6", "deepseek-v4")
ALIASES = {"cl100k": "cl100k_base", "cl100k_base": "cl100k_base",
           "qwen2.5": "qwen2.5", "qwen2": "qwen2.5",
           "qwen3.6": "qwen3.6", "qwen3.5": "qwen3.6",
           "deepseek-v4": "deepseek-v4", "deepseek": "deepseek-v4"}
_BUILDERS: dict[str, Callable[[str], Parts]] = {
    "cl100k_base": lambda name: families.cl100k(),
    "qwen2.5": lambda name: families.qwen(name, "qwen2.5-72b-instruct"),
    "qwen3.6": lambda name: families.qwen(name, "qwen3.6-27b"),
    "deepseek-v4": families.deepseek,
}


class ReferenceTokenizer:
    """One vocabulary's reference encoder; immutable, safe to share across threads."""

    __slots__ = ("_name", "_parts", "_fingerprint", "_fp_lock")

    def __init__(self, name: str, parts: Parts) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_fingerprint", None)
        object.__setattr__(self, "_fp_lock", threading.Lock())

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"ReferenceTokenizer is immutable (cannot set {key!r})")

    def __repr__(self) -> str:
        return f"ReferenceTokenizer({self._name!r}, vocab_size={self.vocab_size})"

    @property
    def name(self) -> str:
        """Family name, or ``file:<abs path>`` for a file."""
        return self._name

    def encode(self, text: str) -> list[int]:
        """The reference ids of the full ``text`` (special tokens in it are recognized)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self._parts.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; a partial UTF-8 sequence becomes U+FFFD."""
        return self._parts.decode_bytes(ids).decode("utf-8", "replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes of ``ids`` (special tokens as their UTF-8 text), for streaming decode."""
        return self._parts.decode_bytes(ids)

    def piece_spans(self, text: str) -> list[tuple[int, int]] | None:
        """Pre-tokenizer pieces of ``text`` as char spans (tokenizer.json families only).

        ``text`` must be normalized and hold no added tokens. tiktoken families return None:
        they expose ``pattern`` instead, as tiktoken has no public piece API.
        """
        fn = self._parts.piece_spans
        return None if fn is None else fn(text)

    @property
    def max_id(self) -> int:
        """Largest id ``encode`` can emit, special and added tokens included."""
        return self._parts.max_id

    @property
    def vocab_size(self) -> int:
        return self._parts.max_id + 1

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text -> id of the tokens split out before pre-tokenization (a copy).

        For tokenizer.json files these are all added tokens, special or not.
        """
        return dict(self._parts.special_tokens)

    @property
    def pattern(self) -> str | None:
        """The pre-tokenizer regex of tiktoken families; None for tokenizer.json ones."""
        return self._parts.pattern

    @property
    def normalization(self) -> str | None:
        """"NFC" for the Qwen families; a tokenizer.json's normalizer types joined by "+"."""
        return self._parts.normalization

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end a generation when emitted (sorted; may be empty)."""
        return self._parts.eos_ids

    @property
    def byte_level(self) -> bool:
        """True when ``decode_bytes`` is exact per token (byte-level BPE)."""
        return self._parts.byte_level

    @property
    def fingerprint(self) -> str:
        """sha256 hex naming the exact vocabulary, independent of the name (computed once).

        tokenizer.json: sha256 of the file bytes. tiktoken: see ``families.tiktoken_fingerprint``.
        Raises TokenizerError if the file changed on disk since it was loaded.
        """
        fp = self._fingerprint
        if fp is None:
            with self._fp_lock:   # hashing reads a multi-MB file; do it once
                fp = self._fingerprint
                if fp is None:
                    fp = self._parts.fingerprint()
                    object.__setattr__(self, "_fingerprint", fp)
        return fp


_cache: dict[Hashable, ReferenceTokenizer] = {}
_key_locks: dict[Hashable, threading.Lock] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every loaded tokenizer (tests; or after a tokenizer file changed on disk)."""
    with _cache_lock:
        _cache.clear()
        _key_locks.clear()


def load_reference(name_or_path: str | os.PathLike[str], *, pattern: str | None = None,
                   special_tokens: Mapping[str, int] | None = None) -> ReferenceTokenizer:
    """The shared reference tokenizer for a family name or a tokenizer file.

    Names (case-insensitive): cl100k_base (cl100k), qwen2.5 (qwen2), qwen3.6 (qwen3.5),
    deepseek-v4 (deepseek). Paths: a tokenizer.json, a directory holding one, or a
    ``*.tiktoken`` rank file, which needs ``pattern=`` and may take ``special_tokens=``.
    """
    key, build = _resolve(name_or_path, pattern, special_tokens)
    with _cache_lock:
        tok = _cache.get(key)
        if tok is not None:
            return tok
        lock = _key_locks.setdefault(key, threading.Lock())
    # One lock per key: the same vocabulary loads once, different ones load in parallel.
    with lock:
        with _cache_lock:
            tok = _cache.get(key)
        if tok is None:
            tok = build()
            with _cache_lock:
                tok = _cache.setdefault(key, tok)
    return tok


def _resolve(name_or_path: Any, pattern: str | None, special_tokens: Mapping[str, int] | None
             ) -> tuple[Hashable, Callable[[], ReferenceTokenizer]]:
    if isinstance(name_or_path, str):
        family = ALIASES.get(name_or_path.strip().lower())
        if family is not None:   # a family name wins; a local dir of that name needs "./"
            if pattern is not None or special_tokens is not None:
                raise ValueError(f"pattern= and special_tokens= apply only to a .tiktoken file, "
                                 f"not to the {family} family")
            return ("family", family), lambda: ReferenceTokenizer(family,
                                                                  _BUILDERS[family](family))
        if not _looks_like_path(name_or_path):
            raise ValueError(f"unknown tokenizer {name_or_path!r}: expected one of "
                             f"{', '.join(FAMILIES)} (aliases: {', '.join(sorted(ALIASES))}), "
                             "or a path to a tokenizer.json (or a directory holding one) or to a "
                             ".tiktoken rank file (with pattern=)")
    elif not isinstance(name_or_path, os.PathLike):
        raise TypeError(f"tokenizer must be a family name or a path, not "
                        f"{type(name_or_path).__name__}")
    path = Path(os.fsdecode(name_or_path)).expanduser()
    suffix = path.suffix.lower()
    specials: dict[str, int] = {}
    # Argument mistakes first: they hold whether or not the file exists.
    if suffix == ".tiktoken":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{path}: a .tiktoken rank file carries no pre-tokenizer regex; "
                             "pass pattern= (the family's regex string)")
        specials = _check_special_tokens(special_tokens)
    elif pattern is not None or special_tokens is not None:
        raise ValueError(f"{path}: pattern= and special_tokens= apply only to a .tiktoken "
                         "file; a tokenizer.json carries its own")
    if not path.exists():
        raise TokenizerError(f"tokenizer file not found: {path}")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"tokenizer directory {path} holds no tokenizer.json")
        path, suffix = path / "tokenizer.json", ".json"
    if suffix not in (".json", ".tiktoken"):
        raise ValueError(f"{path}: unsupported tokenizer file; expected a tokenizer.json (or a "
                         "directory holding one) or a .tiktoken rank file")
    path = path.resolve()
    name = f"file:{path}"
    if suffix == ".tiktoken":
        key: Hashable = ("tiktoken", str(path), pattern, tuple(sorted(specials.items())))
        return key, lambda: ReferenceTokenizer(name, families.tiktoken_file(path, str(pattern),
                                                                            specials))
    return ("tokenizers", str(path)), lambda: ReferenceTokenizer(
        name, families.tokenizer_json(path, name))


def _check_special_tokens(special_tokens: Mapping[str, int] | None) -> dict[str, int]:
    """Validate a user-given special token table (ValueError says what is wrong)."""
    if special_tokens is None:
        return {}
    if not isinstance(special_tokens, Mapping):
        raise ValueError("special_tokens= must be a dict of token text -> id")
    out: dict[str, int] = {}
    for text, tid in special_tokens.items():
        if not isinstance(text, str) or not text:
            raise ValueError(f"special token {text!r}: keys must be non-empty strings")
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ValueError(f"special token {text!r}: id {tid!r} must be an int >= 0")
        out[text] = tid
    if len(set(out.values())) != len(out):
        raise ValueError("special_tokens= gives two tokens the same id")
    return out


def _looks_like_path(s: str) -> bool:
    seps = [os.sep] + ([os.altsep] if os.altsep else []) + ["/"]
    return (any(sep in s for sep in seps) or s.startswith("~")
            or s.lower().endswith((".json", ".tiktoken")) or os.path.exists(s))
