"""IncrementalTokenizer state as (JSON-able meta, byte blobs), and its validated restore.

Blobs: ``text`` (UTF-8), ``ids`` (uint32 little-endian), ``boundaries`` (uint64 little-endian
pairs: char offset, token count). A restore trusts nothing it can check cheaply: types, sizes,
ranges, the vocabulary's fingerprint, NFC form, and the tail's ids against the reference.
"""
from __future__ import annotations

import os
import sys
import unicodedata
from array import array
from typing import Any, Mapping

FORMAT = "capsule.tokenize.incremental/1"
_STATS = ("appends", "windows", "widenings", "fallbacks", "check_failures", "window_chars")


def _le(a: array) -> bytes:
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(code: str, data: Any, what: str) -> array:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"tokenizer state blob {what!r} must be bytes, not {type(data).__name__}")
    a = array(code)
    if len(data) % a.itemsize:
        raise ValueError(f"tokenizer state blob {what!r} has {len(data)} bytes, not a multiple "
                         f"of {a.itemsize}")
    a.frombytes(bytes(data))
    if sys.byteorder == "big":
        a.byteswap()
    return a


def dump(tok: Any) -> tuple[dict, dict[str, bytes]]:
    ids = array("I")
    for c in tok._chunk_ids:
        ids.extend(c)
    ids.extend(tok._tids)
    bounds = array("Q")
    for pos, cnt in zip(tok._bpos, tok._bcnt):
        bounds.extend((pos, cnt))
    text = tok.text
    meta = {"format": FORMAT, "tokenizer": tok.reference.name,
            "fingerprint": tok.reference.fingerprint, "chars": len(text), "tokens": len(ids),
            "full_mode": bool(tok._full_mode), "shadow_rate": tok._shadow.rate,
            "stats": {k: int(tok._stats[k]) for k in _STATS}}
    blobs = {"text": text.encode("utf-8", "surrogatepass"), "ids": _le(ids),
             "boundaries": _le(bounds)}
    return meta, blobs


def _int(meta: Mapping[str, Any], key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"tokenizer state meta {key!r} must be an int >= 0, not {v!r}")
    return v


def load(cls: Any, tokenizer: Any, meta: Mapping[str, Any], blobs: Mapping[str, Any], *,
         verify: bool, shadow_rate: float | None) -> Any:
    from .reference import load_reference
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_reference(tokenizer)
    if not isinstance(meta, Mapping) or not isinstance(blobs, Mapping):
        raise ValueError("tokenizer state must be a (meta dict, blobs dict) pair")
    if meta.get("format") != FORMAT:
        raise ValueError(f"tokenizer state format {meta.get('format')!r} is not {FORMAT!r}")
    fp = meta.get("fingerprint")
    if not isinstance(fp, str) or fp != tokenizer.fingerprint:
        raise ValueError(f"tokenizer state was taken with vocabulary {meta.get('tokenizer')!r} "
                         f"(fingerprint {str(fp)[:16]}...), not {tokenizer.name!r} "
                         f"({tokenizer.fingerprint[:16]}...)")
    n_chars, n_tokens = _int(meta, "chars"), _int(meta, "tokens")
    full = meta.get("full_mode", False)
    if not isinstance(full, bool):
        raise ValueError(f"tokenizer state meta 'full_mode' must be a bool, not {full!r}")
    rate = meta.get("shadow_rate", 0.01) if shadow_rate is None else shadow_rate
    raw = blobs.get("text")
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ValueError("tokenizer state blob 'text' must be bytes")
    try:
        text = bytes(raw).decode("utf-8", "surrogatepass")   # tiktoken accepts lone ones
    except UnicodeDecodeError as exc:
        raise ValueError(f"tokenizer state text is not valid UTF-8: {exc}") from exc
    ids = _from_le("I", blobs.get("ids"), "ids")
    b = _from_le("Q", blobs.get("boundaries"), "boundaries")
    if len(text) != n_chars or len(ids) != n_tokens:
        raise ValueError(f"tokenizer state holds {len(text)} chars and {len(ids)} ids; its meta "
                         f"says {n_chars} and {n_tokens}")
    max_id = getattr(tokenizer, "max_id", None)
    if ids and max_id is not None and max(ids) > max_id:
        raise ValueError(f"tokenizer state holds id {max(ids)} > the vocabulary's {max_id}")
    bpos, bcnt = list(b[0::2]), list(b[1::2])
    if not bpos or len(bpos) != len(bcnt) or any(x >= y for x, y in zip(bpos, bpos[1:])) \
            or any(x >= y for x, y in zip(bcnt, bcnt[1:])) \
            or bpos[-1] > n_chars or bcnt[-1] > n_tokens or (bpos[0] == 0) != (bcnt[0] == 0):
        raise ValueError("tokenizer state boundaries are not increasing (offset, count) pairs "
                         "inside the text")
    tok = cls(tokenizer, shadow_rate=rate)
    if tok._rules is not None and tok._rules.nfc and not unicodedata.is_normalized("NFC", text):
        raise ValueError("tokenizer state text is not NFC-normalized, as this family's is")
    stats = meta.get("stats", {})
    if isinstance(stats, Mapping):
        for k in _STATS:
            v = stats.get(k, 0)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                tok._stats[k] = v
    if verify and list(tokenizer.encode(text)) != ids.tolist():
        raise ValueError("tokenizer state ids differ from the reference on its text")
    b0, c0 = (0, 0) if full or tok._full_mode else (bpos[0], bcnt[0])
    tail, tids = text[b0:], ids[c0:].tolist()
    if not (full or tok._full_mode) and list(tokenizer.encode(tail)) != tids:
        raise ValueError("tokenizer state ids differ from the reference on the text's tail")
    if b0:
        tok._chunks, tok._chunk_ids = [text[:b0]], [ids[:c0]]
        tok._before = text[b0 - 1]
    tok._base, tok._base_n, tok._tail, tok._tids = b0, c0, tail, tids
    tok._bpos, tok._bcnt = [b0], [c0]
    if full:
        tok._full_mode = True
        tok.full_reason = "restored in full mode"
    elif not tok._full_mode:   # boundaries past b0 are recomputed, not trusted
        new_b, failed = tok._rule.scan(tail, tids, b0, c0)
        tok._stats["check_failures"] += failed
        for pos, cnt in new_b:
            tok._bpos.append(pos)
            tok._bcnt.append(cnt)
    tok._freeze()
    return tok
