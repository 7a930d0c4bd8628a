"""The families read from llama.cpp's vocabulary GGUFs: ids equal to the models' own tokenizers.

Beside each ``ggml-vocab-<name>.gguf`` llama.cpp ships a test text (``.inp``, cases separated by
``__ggml_vocab_test__`` lines) and the ids the model's original Hugging Face tokenizer gives for
each case (``.out``, one line per case), made by its tests/test-tokenizer-0.py. Our reference
(the tokenizer.json gguf_vocab.py rebuilds) must give exactly those ids, and so must the
incremental tokenizer when the case is appended in pieces.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from capsule.tokenize import IncrementalTokenizer, load_reference
from capsule.tokenize.registry import all_families
from tokenizer_facts import llama_cpp_vocab

SEPARATOR = "\n__ggml_vocab_test__\n"
# family -> its vocabulary file's name, for every family llama.cpp ships a test text for
GGUF_FAMILIES = {f.name: f.files[0] for f in all_families() if f.package == "share:llama.cpp"}


def cases(vocab: Path) -> list[tuple[str, list[int]]]:
    texts = vocab.with_name(vocab.name + ".inp").read_text("utf-8").split(SEPARATOR)
    ids = vocab.with_name(vocab.name + ".out").read_text("utf-8").split("\n")
    assert len(ids) >= len(texts) >= 40
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids)]


def test_every_gguf_family_is_checked():
    assert set(GGUF_FAMILIES) == {"starcoder2", "refact", "command-r", "gpt-neox", "falcon",
                                  "llama2", "phi3", "gemma4"}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_reference_ids_equal_the_models_own_tokenizer(family):
    ref = load_reference(family)
    vocab = llama_cpp_vocab(GGUF_FAMILIES[family].removeprefix("ggml-vocab-")[:-5])
    got = [(text, ref.encode(text)) for text, _ in cases(vocab)]
    assert got == cases(vocab)


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_incremental_ids_equal_the_models_own_tokenizer(family):
    tok = IncrementalTokenizer.from_family(family)
    vocab = llama_cpp_vocab(GGUF_FAMILIES[family].removeprefix("ggml-vocab-")[:-5])
    joined = "".join(text for text, _ in cases(vocab))
    for cut in (1, 3, 7):   # every case appended in pieces of `cut` chars, one stream
        tok.reset("")
        for i in range(0, len(joined), cut):
            tok.append(joined[i:i + cut])
        assert tok.ids == tok.reference.encode(joined)
    for text, want in cases(vocab):
        tok.reset("")
        for i in range(0, len(text), 2):
            tok.append(text[i:i + 2])
        assert tok.ids == want, text


def test_converter_padding_rows_are_not_added_tokens():
    # refact's GGUF pads its 49152 ids to 49216 with user-defined "[PAD<id>]" rows
    ref = load_reference("refact")
    assert ref.max_id == 49215 and "[PAD49152]" not in ref.special_tokens
    assert len(ref.encode("[PAD49152]")) > 1


def test_missing_vocabulary_files_say_how_to_install_them(tmp_path, monkeypatch):
    import sys

    from capsule.errors import TokenizerError
    from capsule.tokenize import clear_cache
    monkeypatch.setattr(sys, "prefix", str(tmp_path))   # an environment make did not set up
    clear_cache()
    try:
        with pytest.raises(TokenizerError) as err:
            load_reference("falcon").encode("x")
        msg = str(err.value)
        assert "llama_cpp_vocabs.py" in msg and str(tmp_path / "share" / "capsule-vocab") in msg
    finally:
        clear_cache()
