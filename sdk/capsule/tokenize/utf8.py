"""UTF-8 boundaries and the end of a reply that grows token by token (torch-free: the Session's
engine and ``capsule.lite`` cut replies the same way)."""
from __future__ import annotations

from typing import Iterable


def split_incomplete(data: bytes) -> tuple[bytes, bytes]:
    """(data without a UTF-8 character it ends inside, those last 0..3 bytes)."""
    for back in range(1, min(3, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:                 # a continuation byte: look further back
            continue
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 1
        return (data[:-back], data[-back:]) if back < need else (data, b"")
    return data, b""


def check_tail(raw: bytes) -> bytes:
    """``raw`` if split_incomplete could have left it (0..3 bytes that start one UTF-8
    character); ValueError otherwise (a capsule's saved tail is untrusted)."""
    if raw and (len(raw) > 3 or split_incomplete(raw) != (b"", raw)):
        raise ValueError("saved reply tail is not the start of a UTF-8 character")
    return raw


def without_eos(text: str, eos_texts: Iterable[str]) -> str:
    """``text`` without the first of ``eos_texts`` it ends with (a reply that ended on an
    end-of-sequence token is returned without that token's text)."""
    for tail in eos_texts:
        if text.endswith(tail):
            return text[:len(text) - len(tail)]
    return text
