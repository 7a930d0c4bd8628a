"""The GGUF tokenizer folder is reused only when its manifest proves the files unchanged and made
by this code for this GGUF; anything else is rebuilt from the metadata (issue 19: ~200 ms saved
on every open, restores included)."""
from __future__ import annotations

import json

import pytest

import capsule.llm.gguf_tokenizer as gguf_tokenizer
from capsule.gguf_header import read_header
from capsule.llm import resolve_named


@pytest.fixture(scope="module")
def meta():
    return read_header(resolve_named("smollm2-135m")).metadata


@pytest.fixture
def builds(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPSULE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = gguf_tokenizer.tokenizer_files
    monkeypatch.setattr(gguf_tokenizer, "tokenizer_files", lambda m: calls.append(1) or real(m))
    return calls


DIGEST = "ab" * 32


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name in gguf_tokenizer.NAMES}


def test_an_intact_folder_is_reused_without_rebuilding(meta, builds):
    folder = gguf_tokenizer.tokenizer_folder(meta, DIGEST)
    first = _snapshot(folder)
    assert set(first) == gguf_tokenizer.NAMES and len(builds) == 1
    assert gguf_tokenizer.tokenizer_folder(meta, DIGEST) == folder and len(builds) == 1
    assert _snapshot(folder) == first
    assert gguf_tokenizer.tokenizer_folder(meta, "cd" * 32) != folder and len(builds) == 2   # another GGUF


@pytest.mark.parametrize("harm", ["flip", "truncate", "remove", "symlink", "manifest-key", "manifest-junk",
                                  "manifest-extra-name"])
def test_anything_off_is_rebuilt_from_the_metadata(meta, builds, harm, tmp_path):
    folder = gguf_tokenizer.tokenizer_folder(meta, DIGEST)
    want = _snapshot(folder)
    tok, manifest = folder / "tokenizer.json", folder / gguf_tokenizer.MANIFEST
    if harm == "flip":
        data = bytearray(tok.read_bytes())
        data[len(data) // 2] ^= 0x01
        tok.write_bytes(bytes(data))
    elif harm == "truncate":
        tok.write_bytes(tok.read_bytes()[:-10])
    elif harm == "remove":
        (folder / "tokenizer_config.json").unlink()
    elif harm == "symlink":      # a planted link is replaced, its target neither read nor touched
        outside = tmp_path / "outside.json"
        outside.write_bytes(tok.read_bytes())
        tok.unlink()
        tok.symlink_to(outside)
    else:
        doc = json.loads(manifest.read_text())
        if harm == "manifest-key":                 # another code version wrote these files
            doc["key"] = "0" * 64
        elif harm == "manifest-extra-name":
            doc["files"]["../escape"] = doc["files"]["tokenizer.json"]
        manifest.write_text("{not json" if harm == "manifest-junk" else json.dumps(doc))
    assert gguf_tokenizer.tokenizer_folder(meta, DIGEST) == folder and len(builds) == 2
    assert _snapshot(folder) == want and not tok.is_symlink()
    if harm == "symlink":
        assert (tmp_path / "outside.json").read_bytes() == want["tokenizer.json"]
    assert gguf_tokenizer.tokenizer_folder(meta, DIGEST) == folder and len(builds) == 2   # intact again
