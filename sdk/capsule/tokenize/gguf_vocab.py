"""The tokenizer a GGUF file carries in its metadata, as Hugging Face tokenizer files.

``tokenizer_files(meta)`` gives the texts of a ``tokenizer.json`` and a ``tokenizer_config.json``
that ``load_reference`` loads (written side by side into one folder). The pipeline is the one
the model's own Hugging Face tokenizer.json has, not llama.cpp's approximation of it:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with the file's merges; the pre-tokenizer
  (and normalizer) come from ``tokenizer.ggml.pre`` through ``PRE_TOKENIZERS``, each entry the
  layout of the Hugging Face model that llama.cpp's converter names that way.
- ``"llama"``: SentencePiece BPE as the Llama-2 tokenizer.json spells it: byte fallback, merges
  recovered from the scores as transformers does, ``Prepend("▁")`` + ``Replace(" ", "▁")``.
- ``"gemma4"``: BPE over raw UTF-8 with the file's merges and byte fallback, ``Replace(" ", "▁")``
  and no prefix, as transformers' GemmaTokenizer builds it.

Control, unknown and user-defined tokens become added tokens (not normalized), with their
own ids. A token text the file repeats keeps its last id, as llama.cpp and transformers do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .gguf_vocab_fields import (CONTROL, K, UNKNOWN, USER_DEFINED, GgufVocab, fail,
                                read_vocab)
from .patterns import DEEPSEEK_SPLITS, LLAMA3, QWEN2, QWEN35


@dataclass(frozen=True)
class PreTokenizer:
    """The split stages of one ``tokenizer.ggml.pre`` type, as its HF tokenizer.json has them."""
    splits: tuple[str, ...]   # isolated Split regexes before a plain ByteLevel (no regex)
    digits: bool              # Digits(individual_digits) then a ByteLevel with GPT-2's regex
    nfc: bool                 # NFC normalizer (Qwen)
    ignore_merges: bool       # a piece that is a token is taken whole (Llama 3)
    add_bos: bool             # llama.cpp's default where the file has no add_bos_token
    falcon: bool = False      # Falcon's: Punctuation, ByteLevel (GPT-2 regex), 3-digit groups


GPT2 = PreTokenizer((), False, False, False, False)
STARCODER = PreTokenizer((), True, False, False, False)   # SmolLM's tokenizer is StarCoder's
_LLAMA3 = PreTokenizer((LLAMA3,), False, False, True, True)
PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {
    "default": GPT2,   # files converted before llama.cpp recorded the type: GPT-2's regex
    "gpt-2": GPT2,
    "smollm": STARCODER,
    "starcoder": STARCODER,
    "qwen2": PreTokenizer((QWEN2,), False, True, False, False),
    "qwen35": PreTokenizer((QWEN35,), False, True, False, False),
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "deepseek-v3": PreTokenizer(DEEPSEEK_SPLITS, False, False, False, False),
    "falcon": PreTokenizer((), False, False, False, False, falcon=True),
    "refact": STARCODER,
    "command-r": PreTokenizer((), True, True, False, False),   # Cohere's: NFC, then StarCoder's
    "mpt": PreTokenizer((), False, True, False, False),        # GPT-NeoX-20B's: NFC, then GPT-2's
}


def tokenizer_files(meta: Mapping[str, object]) -> dict[str, str]:
    """``{"tokenizer.json": text, "tokenizer_config.json": text}`` from a GGUF's metadata.

    ``meta``: the GGUF's key/value fields as plain python values (``tokenizer.ggml.*``,
    ``tokenizer.chat_template``, ``general.architecture``). Untrusted: a missing, oversized or
    inconsistent field, an id out of range, or an unsupported ``tokenizer.ggml.model`` or
    ``tokenizer.ggml.pre`` raises TokenizerError naming it.
    """
    v = read_vocab(meta)
    if v.model == "gpt2":
        pre = pre_tokenizer_of(v.pre)
        doc, add_bos = _byte_level(v, pre), pre.add_bos
    elif v.model == "llama":
        doc, add_bos = _sentencepiece(v), True   # llama.cpp adds BOS to SPM unless told not to
    elif v.model == "gemma4":
        doc, add_bos = _gemma4(v), True          # llama.cpp forces BOS on for Gemma 4
    else:
        raise fail(K + "model", f"is {v.model!r}; supported: 'gpt2' (byte-level BPE), "
                   "'llama' (SentencePiece BPE) and 'gemma4' (BPE with byte fallback)")
    add_bos = add_bos if v.add_bos is None else v.add_bos
    add_eos = bool(v.add_eos)
    doc["post_processor"] = _template(v, add_bos, add_eos)
    return {"tokenizer.json": json.dumps(_ordered(doc), ensure_ascii=False,
                                         separators=(",", ":")),
            "tokenizer_config.json": json.dumps(_config(v, add_bos, add_eos),
                                                ensure_ascii=False, indent=2)}


def pre_tokenizer_of(pre: str | None) -> PreTokenizer:
    """The entry of a ``tokenizer.ggml.pre`` value (absent: "default"), else TokenizerError."""
    found = PRE_TOKENIZERS.get("default" if pre is None else pre)
    if found is None:
        raise fail(K + "pre", f"is {pre!r}, a pre-tokenizer this SDK does not know; "
                   f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    return found


# ---- the two models ---------------------------------------------------------------------------

def _byte_level_step(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": use_regex}


def _byte_level(v: GgufVocab, pre: PreTokenizer) -> dict[str, Any]:
    if v.merges is None:
        raise fail(K + "merges", "is missing; a byte-level BPE vocabulary needs its merges")
    if pre.splits:
        steps = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
                  "invert": False} for r in pre.splits]
        # trim_offsets only moves offsets; True is the layout rules.py verifies
        pre_tok = {"type": "Sequence", "pretokenizers": [*steps, _byte_level_step(False)]}
    elif pre.digits:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, _byte_level_step(True)]}
    elif pre.falcon:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Punctuation", "behavior": "Contiguous"}, _byte_level_step(True),
            {"type": "Digits", "individual_digits": False},
            {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated",
             "invert": False}]}
    else:
        pre_tok = _byte_level_step(True)
    return {"added_tokens": _added(v),
            "normalizer": {"type": "NFC"} if pre.nfc else None,
            "pre_tokenizer": pre_tok,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": _bpe(v, v.merges, unk=None, spm=False, ignore_merges=pre.ignore_merges)}


def _sentencepiece(v: GgufVocab) -> dict[str, Any]:
    arch = v.architecture or ""
    if arch.startswith("gemma"):   # space tokens and merge order differ there (transformers)
        raise fail("general.architecture", f"is {arch!r}: Gemma's SentencePiece vocabularies "
                   "are not supported (only Llama-style ones)")
    if v.scores is None and v.merges is None:
        raise fail(K + "scores", "is missing; a SentencePiece vocabulary needs its scores")
    merges = v.merges if v.merges is not None else spm_merges(v.tokens, v.scores or ())
    unk_id = v.ids.get("unknown")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(v.types) if t == UNKNOWN), None)
    prefix = v.add_space_prefix is not False   # llama.cpp's SPM default: on
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"added_tokens": _added(v),
            "normalizer": {"type": "Sequence", "normalizers": (
                [{"type": "Prepend", "prepend": "▁"}] if prefix else []) + [replace]},
            "pre_tokenizer": None,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": _bpe(v, merges, unk=None if unk_id is None else v.tokens[unk_id],
                          spm=True, ignore_merges=False)}


def _gemma4(v: GgufVocab) -> dict[str, Any]:
    if v.merges is None:
        raise fail(K + "merges", "is missing; a gemma4 vocabulary needs its merges")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    return {"added_tokens": _added(v), "normalizer": replace,
            # a no-op after the normalizer (no spaces are left), kept as the model's file has it
            "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                              "behavior": "MergedWithPrevious", "invert": False},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": _bpe(v, v.merges, unk=_token(v, "unknown"), spm=True, ignore_merges=False)}


def spm_merges(tokens: Any, scores: Any) -> list[tuple[str, str]]:
    """Merges a SentencePiece BPE vocabulary implies, in transformers' ``generate_merges`` order.

    Each token's splits into two tokens, ordered by the parts' ids; then all of them by the
    merged token's score, then the left and right part's lengths, all descending (stable).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))   # a repeated text keeps its first place, last score
    merges: list[tuple[str, str, float]] = []
    for merged, score in score_of.items():
        local = [(merged[:k], merged[k:]) for k in range(1, len(merged))
                 if merged[:k] in vocab and merged[k:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((a, b, score) for a, b in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _bpe(v: GgufVocab, merges: Any, *, unk: str | None, spm: bool,
         ignore_merges: bool) -> dict[str, Any]:
    return {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": spm, "byte_fallback": spm,
            "ignore_merges": ignore_merges,
            "vocab": {t: i for i, t in enumerate(v.tokens)},
            "merges": [list(m) for m in merges]}


# llama.cpp's converter pads a vocabulary up to the model's embedding rows with user-defined
# "[PAD<id>]" tokens the model's own tokenizer does not have: they stay plain vocabulary
# entries (no merge makes them), not added tokens matched in the text.
def _added(v: GgufVocab) -> list[dict[str, Any]]:
    last = {t: i for i, t in enumerate(v.tokens)}
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": kind != USER_DEFINED}
            for i, (t, kind) in enumerate(zip(v.tokens, v.types))
            if kind in (UNKNOWN, CONTROL, USER_DEFINED) and t and last[t] == i
            and not (kind == USER_DEFINED and t == f"[PAD{i}]")]



# ---- post-processor and config ----------------------------------------------------------------

def _token(v: GgufVocab, name: str) -> str | None:
    i = v.ids.get(name)
    return None if i is None else v.tokens[i]


def _template(v: GgufVocab, add_bos: bool, add_eos: bool) -> dict[str, Any] | None:
    """BOS/EOS around each sequence (applies only with add_special_tokens=True)."""
    bos = _token(v, "bos") if add_bos else None
    eos = _token(v, "eos") if add_eos else None
    if bos is None and eos is None:
        return None

    def seq(letter: str, type_id: int) -> list[dict[str, Any]]:
        out = [{"SpecialToken": {"id": bos, "type_id": type_id}}] if bos is not None else []
        out.append({"Sequence": {"id": letter, "type_id": type_id}})
        if eos is not None:
            out.append({"SpecialToken": {"id": eos, "type_id": type_id}})
        return out

    specials = {t: {"id": t, "ids": [v.ids[n]], "tokens": [t]}
                for n, t in (("bos", bos), ("eos", eos)) if t is not None}
    return {"type": "TemplateProcessing", "single": seq("A", 0),
            "pair": seq("A", 0) + seq("B", 1), "special_tokens": specials}


def _config(v: GgufVocab, add_bos: bool, add_eos: bool) -> dict[str, Any]:
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "add_bos_token": add_bos, "add_eos_token": add_eos,
                              "clean_up_tokenization_spaces": False}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        text = _token(v, name)
        if text is not None:
            config[key] = text
    if v.chat_template is not None:
        config["chat_template"] = v.chat_template
    return config


def _ordered(doc: dict[str, Any]) -> dict[str, Any]:
    # rules.py reads added_tokens/normalizer/pre_tokenizer from the text before "model"
    keys = ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder", "model")
    return {"version": "1.0", "truncation": None, "padding": None,
            **{k: doc[k] for k in keys}}
