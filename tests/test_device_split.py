"""Regex pre-tokenization on tensors equals the families' own pre-tokenizers, piece for piece.

The reference split of a tiktoken family is its pattern run by the regex engine (with Rust's
end-of-text ``$``); of a tokenizer.json family, its own pre-tokenizer (``piece_spans``).
"""
from __future__ import annotations

import itertools

import pytest
import regex
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule.errors import TokenizerError
from capsule.tokenize import family_names, load_reference
from capsule.tokenize.device_split import PATTERN_SPECS, DeviceSplitter, reference_spans, spec_of
from capsule.tokenize.differential import HAZARD, MULTILINGUAL, _texts
from edge_kernels.regex_split import SPECS, decode_utf8

SUPPORTED = {"cl100k_base": "cl100k-pattern", "r50k_base": "r50k-pattern",
             "p50k_base": "r50k-pattern", "llama3": "llama3-pattern", "qwen2.5": "qwen2-pattern",
             "qwen3": "qwen2-pattern", "glm4": "llama3-pattern", "glm4.5": "llama3-pattern",
             "gpt-neox": "gpt2-pattern"}
PATTERNS = {name: pat for pat, name in PATTERN_SPECS.items()}


def pattern_spans(name: str, text: str) -> list[tuple[int, int]]:
    return [m.span() for m in regex.finditer(PATTERNS[name].replace(r"\s++$", r"\s++\Z"), text)]


@pytest.fixture(scope="module")
def splitters() -> dict[str, DeviceSplitter]:
    return {f: DeviceSplitter(load_reference(f)) for f in SUPPORTED}


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    texts = [t for _, t in itertools.islice(_texts(3, 3000, HAZARD), 400)]
    return texts + [MULTILINGUAL, "", " ", "\n", "  \n\n \t", "x  ", "'S 'LL 'ſ 'Re", "١٢٣ ½²"]


def test_the_supported_families_are_the_gpt_family_patterns():
    got = {f: s.name for f in family_names() if (s := spec_of(load_reference(f))) is not None}
    assert got == SUPPORTED


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_splits_equal_the_reference_on_the_differential_corpus(family, splitters, corpus):
    ref, split = load_reference(family), splitters[family]
    for text in corpus:
        assert split.spans(text) == reference_spans(ref, text), (family, text[:200])


HAZARDS = [" ", "  ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u0085", "\u2028", "a", "Z",
           "é", "e\u0301", "\u0301", "ſ", "S", "s", "t", "LL", "re", "VE", "'", "'s", "0", "12",
           "١", "½", "中", "😀", "\u200d", ".", "!", "#", "$", "<|", "\x01"]


@pytest.mark.parametrize("name", sorted(SPECS))
@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(HAZARDS), max_size=40))
def test_splits_equal_the_pattern_on_hazard_strings(name, parts):
    text = "".join(parts)
    split = _by_spec(name)
    assert split.spans(text) == pattern_spans(name, text), repr(text)


class _Ref:   # a tiktoken-style tokenizer: a pattern, no normalizer
    def __init__(self, pattern: str) -> None:
        self.name, self.pattern, self.normalization = "pattern", pattern, None


_SPLITTERS: dict[str, DeviceSplitter] = {}


def _by_spec(name: str) -> DeviceSplitter:
    if name not in _SPLITTERS:
        _SPLITTERS[name] = DeviceSplitter(_Ref(PATTERNS[name]))
    return _SPLITTERS[name]


def test_utf8_decode_equals_python():
    text = "a é 中 😀 \u0085\U0010ffff\x7f"
    data = text.encode("utf-8")
    cp, offsets = decode_utf8(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert cp.tolist() == [ord(c) for c in text]
    assert offsets.tolist() == [len(text[:i].encode("utf-8")) for i in range(len(text))]


def test_other_pipelines_are_refused_by_name():
    for family in ("o200k_base", "deepseek-v4", "tekken", "falcon"):
        with pytest.raises(TokenizerError, match="GPT-family patterns"):
            DeviceSplitter(load_reference(family))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_equals_cpu(corpus):
    for family in ("cl100k_base", "qwen2.5", "r50k_base"):
        ref = load_reference(family)
        cpu, gpu = DeviceSplitter(ref), DeviceSplitter(ref, device="cuda")
        assert gpu.table.device.type == "cuda"
        for text in corpus[:100]:
            data = text.encode("utf-8")
            assert gpu.starts(data).cpu().tolist() == cpu.starts(data).tolist()
