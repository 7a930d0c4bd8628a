"""The reference's ids through the tensor BPE kernel: CPU pre-tokenization, batched merges.

``TensorBpe(ref, device)`` reproduces ``ref.encode`` for the families whose pipeline
``rules_for`` verifies (the same special-token split and pre-tokenizer pieces the incremental
tokenizer uses), with the merges of all pieces of a batch of texts done by
``edge_kernels.bpe`` on CPU or CUDA tensors. The merge semantics follow each family's reference:
tiktoken families rank a pair by its concatenated bytes and emit a piece that is a token as is;
tokenizer.json families apply their listed merges (and ``ignore_merges`` when set).

``kernel`` picks the merge loop: "torch" (``edge_kernels.bpe``: tensor ops, one host sync per
round; CPU or CUDA) or "triton" (``edge_kernels.bpe_fused``: one launch per length bucket, every
round on the device; CUDA, or CPU under TRITON_INTERPRET=1). Both give the same ids; "torch"
stays the default until a GPU run has measured the fused kernel.
"""
from __future__ import annotations

import json
import threading
import unicodedata
from typing import Any, Callable, Mapping, Sequence

import torch

from edge_kernels.bpe import (MergeTable, Packed, merge_packed, pack_pieces, table_from_merges,
                              table_from_ranks, unpack)

from ..errors import TokenizerError
from . import registry
from .families import byte_alphabet
from .packaged import read_vocab_json
from .pieces import PieceScanner
from .reference import ReferenceTokenizer
from .rules import CharInfo, Rules, rules_for

Table = tuple[MergeTable, dict[bytes, int], bytes]   # merges, whole pieces, dropped bytes
_tables: dict[str, Table] = {}
_tables_lock = threading.Lock()
KERNELS = ("torch", "triton")


class TensorBpe:
    """Encodes like ``ref.encode``. Not thread-safe (the scanner memoizes); one per thread."""

    def __init__(self, ref: ReferenceTokenizer, device: torch.device | str = "cpu",
                 kernel: str = "torch") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        rules, why = _usable_rules(ref)
        if rules is None:
            raise TokenizerError(f"{ref.name}: the tensor BPE cannot run it ({why})")
        self.ref, self._nfc = ref, rules.nfc
        info = CharInfo(rules.marks_are_letters, rules.cjk_stage, rules.scheme)
        self._scanner = PieceScanner(ref, rules, info)
        table, self._whole, self._drop = merge_table(ref)
        self.table = table.to(device)
        self.kernel = kernel
        self._merge = self._merger(kernel)

    def _merger(self, kernel: str) -> Callable[[Packed], Packed]:
        if kernel == "torch":
            return lambda packed: merge_packed(packed, self.table)
        from edge_kernels.bpe_fused import hash_table, merge_packed_fused
        hashed = hash_table(self.table)   # once per TensorBpe: ~0.1-0.3 s for 0.1-0.5M merges
        return lambda packed: merge_packed_fused(packed, self.table, hashed)

    def merge(self, pieces: Sequence[bytes]) -> list[list[int]]:
        """BPE ids of each piece (non-empty bytes) by this kernel, on this device."""
        return unpack(self._merge(pack_pieces(pieces, self.table)), len(pieces))

    def merge_packed(self, packed: Packed) -> Packed:
        """The merge step alone, on pieces packed by ``edge_kernels.bpe.pack_pieces``."""
        return self._merge(packed)

    @property
    def whole_pieces(self) -> Mapping[bytes, int]:
        """Pieces that are one vocabulary token already (no merge runs for them)."""
        return self._whole

    @property
    def device(self) -> torch.device:
        return self.table.device

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text; the pieces of all texts are merged in one kernel pass."""
        plans = [self.pre_tokenize(t) for t in texts]
        uniq = list(dict.fromkeys(p for plan in plans for p in plan if isinstance(p, bytes)))
        done = {p: [self._whole[p]] for p in uniq if p in self._whole}
        todo = [p for p in uniq if p not in done]
        if self._drop:   # bytes without a symbol: tokenizers skips them, merging across them
            kept = {p: p.translate(None, self._drop) for p in todo}
            live = list(dict.fromkeys(k for k in kept.values() if k))
            got = dict(zip(live, self.merge(live)))
            done.update((p, got.get(k, [])) for p, k in kept.items())
        else:
            done.update(zip(todo, self.merge(todo)))
        out = []
        for plan in plans:
            ids: list[int] = []
            for p in plan:
                if isinstance(p, bytes):
                    ids += done[p]
                else:
                    ids.append(p)
            out.append(ids)
        return out

    def pre_tokenize(self, text: str) -> list[bytes | int]:
        """The text as pieces (UTF-8 bytes) and special token ids, in order."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        plan: list[bytes | int] = []
        for s, e, sid in self._scanner.split_specials(text):
            if sid is not None:
                plan.append(sid)
                continue
            seg = text[s:e]
            ends = self._scanner.pieces(seg)
            if not ends or ends[-1] != len(seg):
                raise TokenizerError(f"{self.ref.name}: pre-tokenizer pieces do not cover the text")
            at = 0
            for end in ends:
                try:
                    plan.append(seg[at:end].encode("utf-8"))
                except UnicodeEncodeError as exc:
                    raise ValueError(f"{self.ref.name}: text is not valid Unicode (lone "
                                     f"surrogate?): {exc}") from exc
                at = end
        return plan


def unsupported(ref: ReferenceTokenizer) -> str:
    """Why the tensor BPE cannot encode like ``ref`` ("" when it can)."""
    return _usable_rules(ref)[1]


def _usable_rules(ref: ReferenceTokenizer) -> tuple[Rules | None, str]:
    """(the splice rules, "") when the tensor BPE can encode like ``ref``, else (None, why).

    It needs a verified pipeline whose pieces are whole characters: Falcon's stages after
    ByteLevel cut some characters' byte symbols apart (the incremental tokenizer's pieces join
    them back, which the splice needs, but BPE must not merge across such a cut)."""
    rules, why = rules_for(ref)
    if rules is None:
        return None, f"needs a verified pipeline: {why}"
    if not rules.whole_chars:
        return None, "its pre-tokenizer cuts inside characters (stages after ByteLevel)"
    return rules, ""


def merge_table(ref: ReferenceTokenizer) -> Table:
    """(merge table on CPU, whole-piece shortcut, dropped bytes) per vocabulary, built once per
    process."""
    key = ref.fingerprint
    with _tables_lock:
        got = _tables.get(key)
        if got is None:
            got = _tables[key] = (_from_ranks(ref) if ref.pattern is not None
                                  else _from_tokenizer_json(ref))
    return got


def _from_ranks(ref: ReferenceTokenizer) -> Table:
    specials = set(ref.special_tokens.values())
    ranks: dict[bytes, int] = {}
    for i in range(ref.vocab_size):
        if i in specials:
            continue
        try:
            ranks[ref.decode_bytes([i])] = i   # tiktoken: a token's id is its rank
        except ValueError:
            continue   # an unassigned id (cl100k has a few)
    return table_from_ranks(ranks), ranks, b""   # tiktoken emits a piece that is a token as is


def _from_tokenizer_json(ref: ReferenceTokenizer) -> Table:
    name = ref.name
    path = registry.vocab_file(name)
    if path is None:
        raise TokenizerError(f"{name}: tokenizer.json not found for the tensor BPE")
    try:
        meta = json.loads(read_vocab_json(path))
        model: dict[str, Any] = meta["model"]
        added = {t["content"]: t["id"] for t in meta.get("added_tokens") or ()}
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"{path}: unreadable tokenizer.json model: {exc}") from exc
    odd = {k: model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix")
           if model.get(k)}
    if model.get("type") != "BPE" or model.get("byte_fallback") or odd:
        raise TokenizerError(f"{name}: the tensor BPE supports plain byte-level BPE models only "
                             f"(type {model.get('type')!r}, {odd or 'byte_fallback'})")
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if any(len(m) != 2 for m in merges):
        raise TokenizerError(f"{name}: a merge is not a pair of tokens")
    to_byte = byte_alphabet()
    byte_chars = [""] * 256
    for ch, b in to_byte.items():
        byte_chars[b] = ch
    # DeepSeek LLM/Coder keep the symbols of bytes that UTF-8 never holds (0xC0, 0xF5, ...) as
    # added tokens, not in the model's vocab: they name the byte's id all the same
    vocab = {**{c: added[c] for c in byte_chars if c not in vocab and c in added}, **vocab}
    # Falcon, SmolLM2 and StarCoder lack some bytes' symbols (control bytes, 0xF1): tokenizers
    # skips those bytes; id 0 stands in for them in the table, and encode removes them first
    drop = bytes(b for b in range(256) if byte_chars[b] not in vocab)
    table = table_from_merges({**{byte_chars[b]: 0 for b in drop}, **vocab}, merges,
                              byte_chars)   # type: ignore[arg-type]
    whole: dict[bytes, int] = {}
    if model.get("ignore_merges"):   # tokenizers then emits a piece found in the vocab as is
        for tok, i in vocab.items():
            try:
                whole[bytes(to_byte[c] for c in tok)] = i
            except KeyError:
                continue
    return table, whole, drop
