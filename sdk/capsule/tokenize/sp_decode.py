"""Per-token text of non-byte-level tokenizer.json decoders (Metaspace, the Llama-2 layout,
WordPiece): what a token adds after earlier text, and byte-fallback pieces as raw bytes.
Used by families.tokenizer_json's decode_bytes."""
from __future__ import annotations

from typing import Any, Callable, Mapping


def has_decoder(decoder: Any, kind: str) -> bool:
    if isinstance(decoder, dict) and decoder.get("type") == "Sequence":
        return any(has_decoder(d, kind) for d in decoder.get("decoders") or ())
    return isinstance(decoder, dict) and decoder.get("type") == kind


def fallback_byte(piece: str) -> bytes | None:
    """The byte of a byte-fallback piece ``<0xNN>``, read as tokenizers' ByteFallback does."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        hex_ = piece[3:5]
        if all(c in "0123456789abcdefABCDEF" for c in hex_):
            return bytes([int(hex_, 16)])
    return None


def continuation_text(tok: Any, added: Mapping[int, str], max_id: int,
                       byte_fallback: bool) -> Callable[[list[int]], list[str]]:
    """Texts of ids decoded one by one as continuations of earlier text (non-byte-level decoders).

    tokenizers' own decoders treat the first token of a sequence apart (Metaspace drops its
    leading space, a Strip decoder the first character of the fused text), so each id is decoded
    after a fixed context token whose text is then cut off: a token's text is what the decoder
    adds to what came before it, e.g. "▁world" -> " world" (Replace/Metaspace) and "##ld" -> "ld"
    (WordPiece).
    """
    def plain(ids: list[int]) -> list[str]:
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    ctx: int | None = None
    head = ""
    for i in range(min(max_id + 1, 1 << 16)):   # the lowest id of a plain word-like token
        piece = tok.id_to_token(i)
        if i in added or piece is None or (byte_fallback and fallback_byte(piece) is not None):
            continue
        text = tok.decode([i], skip_special_tokens=False)
        if text.isalnum():
            ctx, head = i, text
            break
    if ctx is None:   # no such token: out-of-context texts (a leading space may be lost)
        return plain

    def texts(ids: list[int]) -> list[str]:
        fulls = tok.decode_batch([[ctx, i] for i in ids], skip_special_tokens=False)
        out = [f[len(head):] if f.startswith(head) else None for f in fulls]
        if None in out:   # a decoder that rewrote the context: the token on its own
            out = [o if o is not None else plain([i])[0] for o, i in zip(out, ids)]
        return out

    return texts
