"""Reference tokenizers: the exact ids that every faster tokenizer path in capsule must reproduce.

``load_reference("qwen2.5")`` gives one shared, immutable ``ReferenceTokenizer`` per vocabulary
and process; its ``encode`` is the family's own reference encoder on the full text. A load that
finds the vocabulary in the disk cache (``disk_cache``) serves identity and decoding from it in a
few ms and builds the encoder only when first needed (or on a prefetch thread).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence

from ..errors import TokenizerError
from . import disk_cache, families, registry, sources
from .families import Parts
from .lazy import LazyParts, cached_parts


class ReferenceTokenizer:
    """One vocabulary's reference encoder; immutable, safe to share across threads."""

    __slots__ = ("_name", "_parts", "_fingerprint", "_fp_lock", "_lazy")

    def __init__(self, name: str, parts: Parts, lazy: LazyParts | None = None) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_fingerprint", None)
        object.__setattr__(self, "_fp_lock", threading.Lock())
        object.__setattr__(self, "_lazy", lazy)

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
        """``decode_bytes(ids)`` as text; a partial UTF-8 sequence becomes U+FFFD."""
        return self._parts.decode_bytes(ids).decode("utf-8", "replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes of ``ids``, token by token, for streaming decode.

        Always ``decode_bytes(ids) == b"".join(decode_bytes([i]) for i in ids)``: each token has
        one byte string, whatever comes before or after it, so a reply decoded one token at a
        time equals the reply decoded at once. Added and special tokens give their own text.

        - Byte-level BPE (tiktoken families, tokenizer.json with a ByteLevel decoder): each
          token's exact bytes; a character split over tokens assembles across them.
        - Other tokenizer.json decoders (SentencePiece style: a Metaspace decoder, or the
          Llama-2 Replace("▁", " ") + ByteFallback + Fuse + Strip sequence; WordPiece): a
          token's text as a *continuation* of earlier text, i.e. what the file's decoder adds
          when the token follows other tokens: "▁world" -> b" world", "##ld" -> b"ld". A
          byte-fallback piece ``<0xNN>`` (decoder with ByteFallback) is that single raw byte,
          so a multi-byte character assembles across its pieces. The leading space of the
          first token is kept, as a reply continues its prompt; tokenizers' own
          ``decode(ids)`` drops it (Metaspace prepend, Strip), so there ``decode`` of a whole
          prompt is that text with one more leading space. Decoders whose output for a token
          depends on its neighbours beyond the first position (a BPE ``</w>`` suffix decoder,
          CTC, WordPiece's cleanup of spaces between tokens) are approximated by these
          per-token texts; and where tokenizers' ByteFallback turns a whole run of byte
          pieces that is not valid UTF-8 into U+FFFD per piece, these bytes stay raw.
        """
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
    def pipeline(self) -> str | None:
        """A tokenizer.json's normalizer, pre-tokenizer and added-token flags as JSON (what the
        splice rules check); None for tiktoken vocabularies, whose ``pattern`` says it all."""
        return self._parts.pipeline

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end a generation when emitted (sorted; may be empty)."""
        return self._parts.eos_ids

    @property
    def byte_level(self) -> bool:
        """True for byte-level BPE: each token is a fixed byte string that any decoder gives.

        False for other tokenizer.json decoders, whose ``decode_bytes`` are per-token
        continuation texts (see ``decode_bytes``).
        """
        return self._parts.byte_level

    @property
    def encoder_ready(self) -> bool:
        """True once the reference encoder is built (a disk-cache load builds it on first need)."""
        return self._lazy is None or self._lazy.built is not None

    def prefetch(self) -> None:
        """Start building the encoder on a daemon thread, unless it is built or being built.

        The builders hold the GIL for long stretches (tokenizers' from_str ~0.2 s), so other
        Python threads stall meanwhile; call it when the process has time to spare.
        """
        if self._lazy is not None:
            self._lazy.prefetch()

    @property
    def fingerprint(self) -> str:
        """sha256 hex naming the exact vocabulary, independent of the name (computed once).

        tokenizer.json: sha256 of the file bytes. tiktoken: see ``families.tiktoken_fingerprint``.
        A full load hashes on first access and raises TokenizerError if the file changed on
        disk since it was loaded; a disk-cache load has the one its full load computed.
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
    """Forget every loaded tokenizer (tests; or after a tokenizer file changed on disk).

    The disk cache needs no clearing: each load checks it against the files' sizes and mtimes.
    """
    with _cache_lock:
        _cache.clear()
        _key_locks.clear()


def load_reference(name_or_path: "str | os.PathLike[str] | ReferenceTokenizer", *,
                   pattern: str | None = None, special_tokens: Mapping[str, int] | None = None,
                   prefetch: bool = True) -> ReferenceTokenizer:
    """The shared reference tokenizer for a family name or a tokenizer file.

    Names (case-insensitive): a registered family or alias (``FAMILIES``: cl100k_base,
    o200k_base, llama3, qwen2.5, deepseek-v4, ...). Paths: a tokenizer.json, a directory
    holding one, or a ``*.tiktoken`` rank file, which needs ``pattern=`` and may take
    ``special_tokens=``. A ReferenceTokenizer is returned as is (so ``Session.open(tokenizer=
    load_reference("x.tiktoken", pattern=...))`` works).

    When served from the disk cache the encoder is built on first need; ``prefetch`` starts
    that build on a daemon thread right away (see ``ReferenceTokenizer.prefetch``).
    """
    if isinstance(name_or_path, ReferenceTokenizer):
        if pattern is not None or special_tokens is not None:
            raise ValueError("pattern= and special_tokens= apply to a .tiktoken path, not to a "
                             "loaded ReferenceTokenizer")
        return name_or_path
    key, name, build, files = _resolve(name_or_path, pattern, special_tokens)
    with _cache_lock:
        tok = _cache.get(key)
        if tok is None:
            lock = _key_locks.setdefault(key, threading.Lock())
    # One lock per key: the same vocabulary loads once, different ones load in parallel.
    if tok is None:
        with lock:
            with _cache_lock:
                tok = _cache.get(key)
            if tok is None:
                tok = _load(key, name, build, files())
                with _cache_lock:
                    tok = _cache.setdefault(key, tok)
    if prefetch:
        tok.prefetch()
    return tok


def _load(key: Hashable, name: str, build: Callable[[], Parts],
          files: list[Path] | None) -> ReferenceTokenizer:
    ent = disk_cache.entry(key, name, files)   # stamped before the build reads the files
    cached = disk_cache.load(ent, name) if ent is not None else None
    if ent is not None and cached is not None:
        return ReferenceTokenizer(name, *cached_parts(name, cached, ent, build))
    tok = ReferenceTokenizer(name, build())
    if ent is not None:
        parts = tok._parts
        try:   # the full load's own fingerprint; not memoized, so tok keeps its lazy contract
            fp = parts.fingerprint()
        except TokenizerError:   # changed on disk while loading: nothing true to cache
            return tok
        disk_cache.store(ent, name, parts, fp)
    return tok


_Resolved = tuple[Hashable, str, Callable[[], Parts], Callable[[], "list[Path] | None"]]


def _resolve(name_or_path: Any, pattern: str | None, special_tokens: Mapping[str, int] | None
             ) -> _Resolved:
    """(in-process key, name, full builder, the files the disk cache stamps)."""
    if isinstance(name_or_path, str):
        fam = registry.find_family(name_or_path)
        if fam is not None:   # a family name wins; a local dir of that name needs "./"
            if pattern is not None or special_tokens is not None:
                raise ValueError(f"pattern= and special_tokens= apply only to a .tiktoken file, "
                                 f"not to the {fam.name} family")
            return (("family", fam.name), fam.name, lambda: fam.builder.build(fam),
                    fam.source_files)
        if not _looks_like_path(name_or_path):
            raise registry.UnknownFamily(
                f"unknown tokenizer {name_or_path!r}: expected {registry.known_names()}, or a "
                "path to a tokenizer.json (or a directory holding one) or to a .tiktoken rank "
                "file (with pattern=)")
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
                             "pass pattern= (the family's regex string): load_reference(path, "
                             "pattern=...), which Session.open(tokenizer=...) also takes")
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
    files = lambda: sources.file_sources(path)   # noqa: E731
    if suffix == ".tiktoken":
        key: Hashable = ("tiktoken", str(path), pattern, tuple(sorted(specials.items())))
        return key, name, lambda: families.tiktoken_file(path, str(pattern), specials), files
    return ("tokenizers", str(path)), name, lambda: families.tokenizer_json(path, name), files


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
