"""Hostile, checksum-valid capsules aimed at the host-state format 2 fields: the format version,
each stream's generated ids and tokenizer layout, and its text and ids chunks. Each is refused
by name (the newest valid epoch is restored instead, rollback says why), and an older SDK's
capsule gets UnsupportedHostFormat. See docs/FORMAT.md, "What a Session capsule holds"."""
from __future__ import annotations

import json
import shutil

import pytest

from capsule import CapsuleCorrupt, Session
from capsule.state.manifest import UnsupportedHostFormat
from capsule.store import Store
from capsule.tokenize import load_reference
from forged_epochs import assert_skipped_by_name, forge, two_epochs

RT = {"kv_pool_mb": 8, "max_context": 2048}
LINE = "t=00412 joint3=-1.250 user: move the red cup to bin 7 (120 mm)\n"


def _entry(key, value):
    """edit: the first stream entry's field (``tok.<f>``: its tokenizer's) set, mapped or dropped."""
    def edit(m):
        at, name = m["host"]["streams"][0], key
        if key.startswith("tok."):
            at, name = at["tokenizer"], key[4:]
        if value is DROP:
            del at[name]
        else:
            at[name] = value(at[name]) if callable(value) else value
    return edit


def _blob(key, value):
    """edit: a blob's listed size set, mapped or dropped."""
    def edit(m):
        if value is DROP:
            del m["blobs"][key]
        else:
            m["blobs"][key] = value(m["blobs"].get(key, 0)) if callable(value) else value
    return edit


DROP = object()
HOSTILE = {
    "format-1": (lambda m: m["host"].pop("format"), "host state format 1"),
    "format-3": (lambda m: m["host"].update(format=3), "host state format 3"),
    "generated-a-str": (_entry("generated", "eight"), "host.streams[0].generated"),
    "generated-past-n_ids": (_entry("generated", lambda v: 10_000), "host.streams[0].generated"),
    "no-tokenizer": (_entry("tokenizer", DROP), "host.streams[0].tokenizer"),
    "tokens-off-by-one": (_entry("tok.tokens", lambda v: v + 1), "host.streams[0].tokenizer.tokens"),
    "chars-a-float": (_entry("tok.chars", 1.5), "host.streams[0].tokenizer.chars"),
    "no-system_chars": (_entry("system_chars", DROP), "host.streams[0].system_chars"),
    "chunk-past-the-layout": (_blob("ids.9/main", 4096), "blobs['ids.9/main']"),
    "chunk-index-padded": (_blob("ids.00/main", 4096), "blobs['ids.00/main']"),
    "chunk-of-a-kind-without-chunks": (_blob("gen.0/main", 4), "blobs['gen.0/main']"),
    "chunk-wrong-size": (_blob("ids.0/main", lambda v: v - 4), "blobs['ids.0/main']"),
    "chunk-missing": (_blob("text.0/main", DROP), "text chunks"),
    "rest-of-ids-wrong-size": (_blob("ids/main", lambda v: v + 4), "blobs['ids/main']"),
    "text-too-long-for-its-chars": (_blob("text/main", lambda v: 4 * v + 4), "blobs['text/main']"),
    "no-ids": (_blob("ids/main", DROP), "'ids' blob"),
    "no-generated-ids": (_blob("gen/main", DROP), "'gen' blob"),
    "generated-ids-wrong-size": (_blob("gen/main", lambda v: v - 4), "blobs['gen/main']"),
    "a-format-1-tokenizer-blob": (_blob("tok/main/text", 10), "blobs['tok/main/text']"),
    # checked by the stream importer (the tokenizer's own parse): named in the report too
    "tokenizer-format": (_entry("tok.format", "capsule.tokenize.incremental/1"), "tokenizer state format"),
    "tokenizer-base-outside": (_entry("tok.base", lambda v: [v[0], 10_000]), "'base'"),
    "tokenizer-chunks": (_entry("tok.chunk_ids", 512), "chunks are"),
    "tokenizer-vocabulary": (_entry("tok.fingerprint", "0" * 64), "vocabulary"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout") / "s"
    return path, two_epochs(path, LINE * 70, RT)[1]   # > 4096 chars and > 1024 ids: one chunk of each


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_stream_layout_is_refused_by_name(tmp_path, pristine, case, caplog):
    edit, field = HOSTILE[case]
    path = tmp_path / "s"
    shutil.copytree(pristine[0], path)
    err = assert_skipped_by_name(path, RT, pristine[1], forge(path, edit, in_place=True), field, caplog)
    assert isinstance(err, UnsupportedHostFormat) == case.startswith("format")


def test_an_older_sdk_store_is_refused_saying_so(tmp_path, pristine):
    path = tmp_path / "s"
    shutil.copytree(pristine[0], path)
    with Store.open(path, create=False) as store:      # every epoch a format-1 one
        for epoch in (1, 2):
            manifest, _ = store.load_epoch(epoch)
            m = json.loads(manifest)
            del m["host"]["format"]
            store.write_epoch([], json.dumps(m).encode())
        store.retain(2)
    with pytest.raises(CapsuleCorrupt, match="format 1") as err:
        Session.open(path, device="cpu", runtime=RT)
    assert "another SDK version" in str(err.value) and "restore=False" in str(err.value)
    with Session.open(path, device="cpu", runtime=RT, restore=False) as s:   # the way out
        s.append("fresh")
        assert s.tokens() == load_reference("cl100k_base").encode("fresh")


def _ids_page(path) -> bytes:
    with Store.open(path, create=False) as store:
        _, pages = store.load_epoch(2)
        return bytes(pages["host/ids/main"][0])     # a copy: the map closes with the store


def test_an_id_outside_the_vocabulary_is_refused(tmp_path, pristine):
    path = tmp_path / "s"
    shutil.copytree(pristine[0], path)
    page = _ids_page(path)
    bad = forge(path, lambda m: m, pages=[("host/ids/main", 0, page[:-4] + b"\xf0\xff\xff\xff")])
    with Session.open(path, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 2
        assert f"epoch {bad}" in s.restore_report[0] and "vocabulary" in s.restore_report[0]


def test_a_wrong_id_inside_the_vocabulary_is_repaired_by_the_next_append(tmp_path, pristine):
    path = tmp_path / "s"
    shutil.copytree(pristine[0], path)
    page = _ids_page(path)
    bad = forge(path, lambda m: m, pages=[("host/ids/main", 0, page[:-4] + (7).to_bytes(4, "little"))])
    with Session.open(path, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == bad               # its checks pass; the tail is re-checked later
        s.append(" and on")
        ref = load_reference("cl100k_base")
        assert s.tokens() == ref.encode(s.text())    # one full re-encode: exact again
        assert s.engine.stream("main").tok.stats["fallbacks"] >= 1
