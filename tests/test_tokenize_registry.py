"""The family registry is the only list of tokenizer families: every record loads, its aliases
resolve, its files are found, its splice rule holds; a family added at run time works end to end."""
from __future__ import annotations

import ast
import hashlib
import importlib
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from capsule.errors import TokenizerError
from capsule.tokenize import (Family, IncrementalTokenizer, UnknownFamily, all_families,
                              clear_cache, family_names, get_family, load_reference,
                              register_family, unregister_family)
from capsule.tokenize import kinds
from capsule.tokenize.families import tiktoken_fingerprint
from capsule.tokenize.patterns import VERIFIED
from capsule.tokenize.registry import find_family, vocab_file
from capsule.tokenize.rules import rules_for
from capsule.tokenize.tensor_bpe import TensorBpe
from tokenizer_facts import FACTS, package_file

SDK = Path(__file__).resolve().parents[1] / "sdk" / "capsule"
TEXT = "user: bring me the red cup <｜end▁of▁sentence｜> 12345 café\n\n  def f(x):\n"


def test_the_tests_facts_cover_exactly_the_registry():
    assert set(FACTS) == set(family_names()), ("a family needs its record in tokenize/"
                                               "registry.py and its facts in tokenizer_facts.py")


def test_no_other_module_lists_families():
    names = {n for f in all_families() for n in (f.name, *f.aliases)}
    found = []
    modules = [*(SDK / "tokenize").glob("*.py"), *(SDK / "bench").glob("tokenize*.py")]
    for path in sorted(modules):
        # gguf_vocab.py keys llama.cpp's tokenizer.ggml.pre names ("qwen2", ...): the file
        # format's vocabulary, not a list of our families
        if path.name in ("registry.py", "gguf_vocab.py"):
            continue
        tree = ast.parse(path.read_text("utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.name}:{c.lineno} {c.value!r}" for c in ast.walk(tree)
                  if isinstance(c, ast.Constant) and c.value in names and id(c) not in docs]
    assert not found, f"family names outside registry.py (read the registry instead): {found}"


@pytest.mark.parametrize("name", family_names())
def test_record_loads_resolves_and_finds_its_files(name):
    fam = get_family(name)
    tok = load_reference(name)
    assert tok.name == fam.name == name
    for alias in (*fam.aliases, name.upper(), f"  {name} "):
        assert get_family(alias) is fam and load_reference(alias) is tok
    files = fam.source_files()
    assert files is not None and all(f.is_file() for f in files), files
    assert files[0] == vocab_file(name) == package_file(fam.package, fam.files[0])
    # files[0] is the vocabulary: the bytes the fingerprint hashes
    data = files[0].read_bytes()
    if files[0].suffix == ".zip":   # the fingerprint is the tokenizer.json's, not the zip's
        data = zipfile.ZipFile(files[0]).read("tokenizer.json")
    want = (hashlib.sha256(data).hexdigest() if fam.library == "tokenizers"
            else tiktoken_fingerprint(data, tok.pattern, tok.special_tokens))
    assert tok.fingerprint == want


# the families whose pipeline is not (yet) proven for the windowed path, and why
FULL_MODE = {"llama2": "not a byte-level BPE", "phi3": "not a byte-level BPE",
             "gemma4": "not a byte-level BPE"}


@pytest.mark.parametrize("name", family_names())
def test_record_names_the_splice_rule_its_pipeline_has(name):
    fam, ref = get_family(name), load_reference(name)
    if name in FULL_MODE:   # a pipeline no splice rule is proven for: exact full re-encodes
        assert fam.splice is None and rules_for(ref)[0] is None
        tok = IncrementalTokenizer(ref)
        assert tok.full_mode and FULL_MODE[name] in tok.full_reason
        return
    assert fam.splice in VERIFIED
    rules, why = rules_for(ref)
    assert rules is not None, why
    assert rules.kind == ("regex" if fam.library == "tiktoken" else "spans")
    assert rules.marks_are_letters == VERIFIED[fam.splice].marks_are_letters
    assert not IncrementalTokenizer(ref).full_mode


def test_unknown_names_say_which_exist():
    with pytest.raises(UnknownFamily) as err:
        get_family("falcon-h9")
    assert isinstance(err.value, TokenizerError)
    assert all(n in str(err.value) for f in all_families() for n in (f.name, *f.aliases))
    with pytest.raises(UnknownFamily):
        unregister_family("falcon-h9")


def test_bad_records_are_refused_with_what_to_fix():
    cl = get_family("cl100k_base")
    for change, why in (({"name": "Cl100k"}, "lower case"), ({"aliases": ("a/b",)}, "'/'"),
                        ({"aliases": ["x"]}, "tuple"), ({"files": ()}, "at least one"),
                        ({"files": ("../x",)}, "relative"),
                        ({"splice": "nope"}, "cl100k-pattern, qwen2-pattern"),
                        ({"arg": None}, "needs arg="), ({"builder": "tiktoken"}, "kinds.Builder")):
        with pytest.raises(TokenizerError, match=why):
            replace(cl, **change)
    with pytest.raises(TokenizerError, match="'cl100k' \\(family cl100k_base\\) already taken"):
        register_family(replace(cl, name="other", aliases=("cl100k",)))
    with pytest.raises(TokenizerError, match="repeated"):
        register_family(replace(cl, name="other", aliases=("x", "x")))
    with pytest.raises(TokenizerError, match="takes no arg="):
        replace(get_family("deepseek-v4"), arg="x")
    assert set(family_names()) == set(FACTS)   # nothing half-registered


@pytest.fixture
def extra():
    """Register records for one test; removed (and the in-process cache cleared) afterwards."""
    added: list[str] = []

    def add(fam: Family) -> Family:
        added.append(register_family(fam).name)
        return fam
    yield add
    for name in added:
        if find_family(name) is not None:   # a test may have removed it itself
            unregister_family(name)
    clear_cache()


def _docs_example() -> Family:
    """The record docs/TOKENIZATION.md shows, as BUILTIN would hold it."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "TOKENIZATION.md").read_text("utf-8")
    section = doc.split("## Adding a tokenizer family", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0].strip().rstrip(",")
    return eval(code, {"Family": Family, "kinds": kinds})


def test_the_docs_example_family_works_end_to_end(tmp_path, monkeypatch, extra):
    # The package it describes, built by an existing kind: DeepSeek's files under a new name.
    fam = _docs_example()
    pkg = tmp_path / fam.package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for src, rel in zip(get_family("deepseek-v4").source_files(), fam.files):
        shutil.copyfile(src, pkg / rel)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    extra(fam)
    assert fam.name in family_names()
    ds, tok = load_reference("deepseek-v4"), load_reference(fam.aliases[0].upper(), prefetch=False)
    assert tok.name == fam.name and load_reference(fam.name) is tok
    assert tok.encode(TEXT) == ds.encode(TEXT) and tok.eos_ids == ds.eos_ids
    assert tok.fingerprint == ds.fingerprint   # the same bytes: the name is not part of it
    assert fam.source_files()[0] == vocab_file(fam.name) == pkg / fam.files[0]
    inc = IncrementalTokenizer.from_family(fam.aliases[0], shadow_rate=0.0)
    assert not inc.full_mode, inc.full_reason
    for part in ("hello ", "world", "  \n", "x", TEXT):
        inc.append(part)
        assert inc.ids == ds.encode(inc.text)
    assert TensorBpe(tok).encode(TEXT) == ds.encode(TEXT)
    clear_cache()   # the next load is served from the disk cache, stamped with the record's files
    again = load_reference(fam.name, prefetch=False)
    assert again is not tok and not again.encoder_ready and again.fingerprint == ds.fingerprint
    assert unregister_family(fam.aliases[0]) is fam
    assert fam.name not in family_names()
    with pytest.raises(UnknownFamily, match=f"unknown tokenizer '{fam.name}'"):
        load_reference(fam.name)


def test_a_record_whose_splice_rule_is_wrong_runs_in_full_mode(extra):
    cl = get_family("cl100k_base")
    extra(replace(cl, name="cl100k-copy", aliases=(), splice="qwen2-pattern"))
    extra(replace(cl, name="cl100k-unspliced", aliases=(), splice=None))
    copy = load_reference("cl100k-copy")
    assert copy.fingerprint == load_reference("cl100k_base").fingerprint
    wrong = IncrementalTokenizer(copy, shadow_rate=0.0)
    assert wrong.full_mode and "fix the record's splice" in wrong.full_reason
    off = IncrementalTokenizer(load_reference("cl100k-unspliced"), shadow_rate=0.0)
    assert off.full_mode and "splice=None" in off.full_reason
    for tok in (wrong, off):
        tok.append(TEXT)
        assert tok.ids == copy.encode(TEXT)   # exact either way
