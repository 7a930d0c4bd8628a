"""Reference encoders from tiktoken objects and tokenizer files: the libraries' own, wired.

Each builder returns :class:`Parts`; ``reference.py`` wraps them in a ``ReferenceTokenizer``.
``kinds.py`` builds a registered family's package through these.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import TokenizerError
from .sp_decode import continuation_text, fallback_byte, has_decoder

# Texts of tokens that end a generation in common chat formats; used where no config names one.
KNOWN_EOS = ("<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "<|eot_id|>",
             "<|end_of_text|>", "</s>", "<end_of_turn>")


@dataclass(frozen=True)
class Parts:
    """Everything a ReferenceTokenizer needs, built once per vocabulary."""
    encode: Callable[[str], list[int]]
    decode_bytes: Callable[[Sequence[int]], bytes]
    max_id: int
    special_tokens: Mapping[str, int]
    pattern: str | None
    normalization: str | None
    eos_ids: tuple[int, ...]
    fingerprint: Callable[[], str]
    piece_spans: Callable[[str], list[tuple[int, int]]] | None
    byte_level: bool
    pipeline: str | None = None   # tokenizer.json: its normalizer, pre-tokenizer and added-token
    #                               flags as JSON (what rules.py checks); None for tiktoken


# ---- files and fingerprints -------------------------------------------------------------------

def file_stamp(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot stat the tokenizer file: {exc}") from exc
    return (st.st_size, st.st_mtime_ns)


def read_file(path: Path) -> bytes:
    """A tokenizer file's bytes; TokenizerError if it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read the tokenizer file: {exc}") from exc


def read_unchanged(path: Path, stamp: tuple[int, int],
                   read: Callable[[Path], bytes] = read_file) -> bytes:
    """``read(path)`` if the file is still the one stamped at load, else TokenizerError."""
    # The fingerprint binds checkpoints, so it must describe the bytes that were loaded,
    # not whatever the file holds now.
    data = read(path)
    if file_stamp(path) != stamp or (read is read_file and len(data) != stamp[0]):
        raise TokenizerError(f"{path} changed on disk after it was loaded; call clear_cache() "
                             "and load it again before fingerprinting")
    return data


def tiktoken_fingerprint(rank_bytes: bytes, pattern: str, specials: Mapping[str, int]) -> str:
    """sha256 over rank file bytes, then pattern, then sorted special tokens (NUL-separated)."""
    h = hashlib.sha256(rank_bytes)   # base64 rank files hold no NUL: separators are unambiguous
    h.update(b"\0pattern\0" + pattern.encode("utf-8", "surrogatepass"))
    h.update(b"\0special\0" + json.dumps(sorted(specials.items()), ensure_ascii=False)
             .encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _eos(specials: Mapping[str, int], names: Sequence[str]) -> tuple[int, ...]:
    return tuple(sorted({specials[n] for n in names if n in specials}))


def _bad_ids(name: str, exc: Exception) -> ValueError:
    return ValueError(f"{name}: token ids must be ints of this vocabulary ({exc})")


# ---- tiktoken encodings -----------------------------------------------------------------------

def tiktoken_parts(name: str, enc: Any, encode: Callable[[str], list[int]], rank_path: Path,
                   stamp: tuple[int, int], normalization: str | None,
                   eos_names: Sequence[str]) -> Parts:
    try:   # tiktoken keeps these private; the incremental tokenizer needs both
        pattern, specials = str(enc._pat_str), dict(enc._special_tokens)
    except AttributeError as exc:
        raise TokenizerError(f"{name}: this tiktoken version hides its pattern ({exc})") from exc

    def decode_bytes(ids: Sequence[int]) -> bytes:
        try:
            return enc.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError) as exc:
            raise _bad_ids(name, exc) from exc

    def fingerprint() -> str:
        return tiktoken_fingerprint(read_unchanged(rank_path, stamp), pattern, specials)

    return Parts(encode=encode, decode_bytes=decode_bytes, max_id=int(enc.max_token_value),
                 special_tokens=specials, pattern=pattern, normalization=normalization,
                 eos_ids=_eos(specials, eos_names), fingerprint=fingerprint, piece_spans=None,
                 byte_level=True)


def parse_ranks(path: Path, data: bytes) -> dict[bytes, int]:
    """A ``.tiktoken`` rank file's ranks, every line and the 256 single bytes checked."""
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for lineno, line in enumerate(data.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            if len(fields) != 2:
                raise ValueError("expected '<base64 token> <rank>'")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
            if rank < 0 or rank in seen or token in ranks:
                raise ValueError("negative or repeated rank, or repeated token")
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{path}: line {lineno} is not a rank entry: {exc}") from exc
        ranks[token] = rank
        seen.add(rank)
    # tiktoken panics (uncatchable as Exception) on a byte it cannot rank, so check up front.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: not a byte-level BPE rank file: {len(missing)} of the 256 "
                             f"single bytes have no rank (first 0x{missing[0]:02x})")
    return ranks


def tiktoken_file(path: Path, pattern: str, special_tokens: Mapping[str, int]) -> Parts:
    """A tiktoken Encoding over a ``.tiktoken`` rank file with the caller's pattern."""
    import tiktoken
    name = f"file:{path}"
    stamp = file_stamp(path)
    ranks = parse_ranks(path, read_file(path))
    specials = dict(special_tokens or {})   # validated by load_reference
    clash = sorted(set(specials.values()) & set(ranks.values()))
    if clash:
        raise ValueError(f"special_tokens= reuses ids of {path}'s ranks: {clash[:5]}")
    try:
        enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks,
                                special_tokens=specials)
    except ValueError as exc:
        raise ValueError(f"pattern= is not a regex tiktoken accepts: {exc}") from exc
    return tiktoken_parts(name, enc, lambda t: enc.encode(t, allowed_special="all"), path,
                          stamp, None, KNOWN_EOS)


# ---- tokenizer.json files ---------------------------------------------------------------------

def byte_alphabet() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE character -> byte."""
    bs = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _normalizer_types(spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [t for s in spec.get("normalizers") or () for t in _normalizer_types(s)]
    return [str(spec["type"])] if spec.get("type") else []


def _is_byte_level(decoder: Any) -> bool:
    if isinstance(decoder, dict) and decoder.get("type") == "Sequence":
        subs = decoder.get("decoders") or ()
        return bool(subs) and all(_is_byte_level(d) for d in subs)
    return isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"


def _config_eos(path: Path) -> list[str]:
    # tokenizer_config.json is optional and only adds eos candidates, so a bad one is ignored.
    try:
        config = json.loads((path.parent / "tokenizer_config.json").read_text("utf-8"))
        eos = config.get("eos_token")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return [eos] if isinstance(eos, str) else []


def tokenizer_json(path: Path, name: str, eos: Sequence[str] = (),
                   read: Callable[[Path], bytes] = read_file,
                   hashed: Callable[[Path], bytes] | None = None) -> Parts:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json, encoding with add_special_tokens=False.

    ``eos``: texts of the tokens that end a generation; () guesses them (the eos_token of a
    tokenizer_config.json beside the file, then ``KNOWN_EOS``). ``read(path)`` gives the JSON
    bytes (a zip member, for a packaged zip); the fingerprint is the sha256 of
    ``hashed(path)`` (default: those JSON bytes).
    """
    from tokenizers import Tokenizer
    stamp = file_stamp(path)
    try:
        text = read(path).decode("utf-8")
        meta = json.loads(text)
        tok = Tokenizer.from_str(text)
        added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        max_id = max(tok.get_vocab(with_added_tokens=True).values())
    except TokenizerError:
        raise
    except Exception as exc:   # UnicodeDecodeError, JSONDecodeError, tokenizers' own Exception
        raise TokenizerError(f"{path}: not a valid tokenizer.json: {exc}") from exc
    # The reference is the full text's ids: a file's truncation or padding must not apply.
    tok.no_truncation()
    tok.no_padding()
    specials = {content: i for i, content in sorted(added.items())}

    def encode(t: str) -> list[int]:
        try:
            return tok.encode(t, add_special_tokens=False).ids
        except TypeError as exc:   # a str with lone surrogates cannot cross into Rust
            msg = f"{name}: text is not valid Unicode (lone surrogate?): {exc}"
            raise ValueError(msg) from exc

    byte_level = _is_byte_level(meta.get("decoder"))
    byte_fallback = has_decoder(meta.get("decoder"), "ByteFallback")
    alphabet = byte_alphabet()
    memo: dict[int, bytes] = {}   # id -> bytes; racing writers store equal values
    texts: list[Callable[[list[int]], list[str]]] = []   # built on the first decode

    def piece_bytes(i: int) -> bytes | None:
        """A token's bytes when they need no decoder call (else None); KeyError: no such id."""
        if i in added:   # added/special tokens come out as their own text
            return added[i].encode("utf-8")
        s = tok.id_to_token(i)
        if s is None:
            raise KeyError(f"no token with id {i}")
        if byte_level:
            try:
                return bytes([alphabet[c] for c in s])
            except KeyError:   # as tokenizers' ByteLevel decoder: off-alphabet = own text
                return s.encode("utf-8")
        return fallback_byte(s) if byte_fallback else None

    def decode_bytes(ids: Sequence[int]) -> bytes:
        try:
            out = [memo.get(i) for i in ids]
            if None in out:
                missing: dict[int, None] = {}
                for i in ids:
                    if i not in memo:
                        b = piece_bytes(i)
                        if b is None:
                            missing[i] = None
                        else:
                            memo[i] = b
                if missing:
                    if not texts:
                        texts.append(continuation_text(tok, added, max_id, byte_fallback))
                    for i, t in zip(missing, texts[0](list(missing))):
                        memo[i] = t.encode("utf-8")
                out = [memo[i] for i in ids]
            return b"".join(out)   # type: ignore[arg-type]
        except (KeyError, OverflowError, TypeError) as exc:
            raise _bad_ids(name, exc) from exc

    pre = tok.pre_tokenizer

    def piece_spans(t: str) -> list[tuple[int, int]]:
        if pre is None:
            return [(0, len(t))] if t else []
        return [span for _, span in pre.pre_tokenize_str(t)]

    return Parts(encode=encode, decode_bytes=decode_bytes, max_id=max_id,
                 special_tokens=specials, pattern=None,
                 normalization="+".join(_normalizer_types(meta.get("normalizer"))) or None,
                 eos_ids=_eos(specials, eos or [*_config_eos(path), *KNOWN_EOS]),
                 fingerprint=lambda: hashlib.sha256(
                     read_unchanged(path, stamp, hashed or read)).hexdigest(),
                 piece_spans=piece_spans, byte_level=byte_level, pipeline=pipeline_of(meta))


def pipeline_of(meta: Mapping[str, Any]) -> str:
    """What the splice rules read from a tokenizer.json: normalizer, pre-tokenizer, added-token
    flags (the vocabulary left out), as canonical JSON."""
    keys = ("content", "normalized", "lstrip", "rstrip", "single_word")
    added = [{k: t.get(k) for k in keys} for t in meta.get("added_tokens") or ()
             if isinstance(t, dict)]
    return json.dumps({"normalizer": meta.get("normalizer"),
                       "pre_tokenizer": meta.get("pre_tokenizer"), "added_tokens": added},
                      ensure_ascii=False, sort_keys=True)
