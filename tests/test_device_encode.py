"""Full encodes on the device (split, rows, merges as tensor work) equal the reference's ids."""
from __future__ import annotations

import itertools

import pytest
import torch

from capsule.errors import TokenizerError
from capsule.tokenize import load_reference
from capsule.tokenize.device_encode import DeviceEncoder
from capsule.tokenize.differential import HAZARD, _own_hazards, _texts

# r50k_base: a tiktoken family (GPT-2's regex, whole-piece lookup proven a no-op);
# qwen3: a tokenizer.json family (NFC, one Split then ByteLevel)
FAMILIES = ("r50k_base", "qwen3")


@pytest.fixture(scope="module")
def encoders() -> dict[str, DeviceEncoder]:
    return {f: DeviceEncoder(load_reference(f)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_the_reference_on_the_differential_corpus(family, encoders):
    ref, enc = load_reference(family), encoders[family]
    hazards = HAZARD + _own_hazards(ref, 7)   # the family's special tokens, whole and cut
    texts = [t for _, t in itertools.islice(_texts(7, 1500, hazards), 30)]
    for text in texts + ["", " ", "<|endoftext|>", "a<|endoftext|>b  \n", "e\u0301 café"]:
        got = enc.encode(text)
        assert got.dtype == torch.int64 and got.device == enc.device
        assert got.tolist() == ref.encode(text), (family, text[:200])


def test_the_fused_kernel_under_the_interpreter_gives_the_same_ids():
    ref = load_reference("qwen3")
    enc = DeviceEncoder(ref, kernel="triton")   # TRITON_INTERPRET=1 on CPU (conftest)
    for text in ("Hello, world! It's 2024.\n\n  x = 12345", "中文测试 👩\u200d👩 don't"):
        assert enc.encode(text).tolist() == ref.encode(text)


def test_vocabularies_with_unreachable_whole_tokens_are_refused():
    # Llama 3 extends cl100k with tokens its merges never build: the host path looks whole
    # pieces up, the device path cannot, so it refuses rather than differ
    with pytest.raises(TokenizerError, match="588 whole tokens"):
        DeviceEncoder(load_reference("llama3"))
    with pytest.raises(TokenizerError, match="GPT-family patterns"):
        DeviceEncoder(load_reference("deepseek-v4"))
    with pytest.raises(TokenizerError, match="GPT-family patterns"):
        DeviceEncoder(load_reference("falcon"))
    with pytest.raises(TokenizerError, match="verified pipeline"):
        DeviceEncoder(load_reference("llama2"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_full_encode_equals_the_reference():
    for family in ("cl100k_base", "r50k_base", "qwen3"):
        ref = load_reference(family)
        for kernel in ("torch", "triton"):
            enc = DeviceEncoder(ref, device="cuda", kernel=kernel)
            texts = [t for _, t in itertools.islice(_texts(9, 3000, HAZARD), 50)]
            for text in texts:
                got = enc.encode(text)
                assert got.device.type == "cuda" and got.tolist() == ref.encode(text)
