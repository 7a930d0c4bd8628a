"""Hostile, checksum-valid manifests and oversized records: a typed CapsuleCorrupt naming the epoch
and the field, a fallback to the newest valid epoch at open, one line in `capsule inspect` /
`capsule verify`, and nothing allocated for what the session could never hold."""
from __future__ import annotations

import json
import shutil

import pytest

from capsule import Session
from capsule.cli import main
from capsule.state.manifest import MAX_MANIFEST_BYTES
from forged_epochs import assert_skipped_by_name, forge, two_epochs

RT = {"kv_pool_mb": 8, "max_context": 1024}
TEXT = "user: the charger is in bay 2; bring the red cup.\n" * 6
DEEP = "[" * 200_000 + "]" * 200_000


def _set(path: str, value):
    """edit: manifest[path...] = value ('.'-separated; ints index lists)."""
    def edit(m):
        *head, last = path.split(".")
        at = m
        for k in head:
            at = at[int(k)] if isinstance(at, list) else at[k]
        at[int(last) if isinstance(at, list) else last] = value
        return m
    return edit


def _raw(marker_path: str, raw: str):
    """edit: put raw JSON text (which json.dumps could not write, or writes as NaN) at a field."""
    def edit(m):
        text = json.dumps(_set(marker_path, "@@RAW@@")(m))
        return text.replace('"@@RAW@@"', raw).encode()
    return edit


HOSTILE = {
    "deep-nesting": (_raw("host.app_state", DEEP), "nested"),
    "nan-app-state": (_raw("host.app_state", "NaN"), "NaN"),
    "nan-inside-app-state": (_set("host.app_state", {"pose": float("nan")}), "NaN"),
    "not-json": (lambda m: b"\xff\xfe not json", "UTF-8"),
    "truncated-json": (lambda m: json.dumps(m).encode()[:-7], "not valid JSON"),
    "top-level-list": (lambda m: [m], "manifest"),
    "nul-not-json": (lambda m: b"\x00 not json at all", "not valid JSON"),
    "no-host": (lambda m: {"binding": m["binding"], "blobs": m["blobs"]}, "'host'"),
    "host-a-str": (_set("host", "streams"), "host"),
    "streams-not-a-list": (_set("host.streams", {"not": "a list"}), "host.streams"),
    "stream-entry-not-a-dict": (_set("host.streams", [1, "two"]), "host.streams[0]"),
    "n_ids-a-str": (_set("host.streams.0.n_ids", "many"), "host.streams[0].n_ids"),
    "n_ids-a-bool": (_set("host.streams.0.n_ids", True), "host.streams[0].n_ids"),
    "n_ids-past-max_context": (_set("host.streams.0.n_ids", 1025), "host.streams[0].n_ids"),
    "name-an-int": (_set("host.streams.0.name", 7), "host.streams[0].name"),
    "region-a-list": (_set("host.streams.0.region", [0, 16]), "host.streams[0].region"),
    "app-state-a-list": (_set("host.app_state", [1, 2]), "host.app_state"),
    "policy-a-str": (_set("host.policy", "queued"), "host.policy"),
    "blobs-a-list": (_set("blobs", [1, 2]), "blobs"),
    "blob-size-negative": (_set("blobs.ids/main", -4), "blobs['ids/main']"),
    "blob-size-a-float": (_set("blobs.ids/main", 4.0), "blobs['ids/main']"),
    "blob-larger-than-max_context": (_set("blobs.ids/main", 4 * 1024 + 4), "blobs['ids/main']"),
    "blob-of-no-stream": (_set("blobs.ids/ghost", 4), "blobs['ids/ghost']"),
    "many-blobs": (lambda m: {**m, "blobs": {**m["blobs"], **{f"tok/main/k{i}": 0 for i in range(20_000)}}},
                   "blobs"),
    "binding-not-an-object": (_set("binding", "abc"), "binding"),
    "binding-model-an-int": (_set("binding.model", 5), "binding.model"),
    "binding-unknown-key": (_set("binding.extra", 1), "binding"),
    "labels-bad": (_set("binding.labels", {"layout": {"max_context": {"x": 1}}}), "binding.labels.layout"),
    "unknown-format-version": (_set("binding.format_version", 99), "binding.format_version"),
    "an-older-format-version": (_set("binding.format_version", 2), "binding.format_version"),
    "manifest-too-big": (_set("host.app_state", {"log": "x" * (MAX_MANIFEST_BYTES + 10)}), "bytes"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "s"
    return path, two_epochs(path, TEXT, RT)[1]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_newest_manifest_is_skipped_by_name(tmp_path, pristine, case, caplog):
    edit, field = HOSTILE[case]
    path = tmp_path / "s"
    shutil.copytree(pristine[0], path)
    assert_skipped_by_name(path, RT, pristine[1], forge(path, edit), field, caplog)


def test_inspect_and_verify_give_one_line_per_bad_epoch_and_go_on(tmp_path, capsys):
    path = tmp_path / "s"
    two_epochs(path, TEXT, RT)
    deep = forge(path, HOSTILE["deep-nesting"][0])
    bad_entry = forge(path, _set("host.streams", [1, "two"]))
    assert main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    damaged = [line for line in out.splitlines() if line.startswith("damaged:")]
    assert len(damaged) == 2 and f"epoch {deep}:" in damaged[0] + damaged[1]
    assert any(f"epoch {bad_entry}: manifest field host.streams[0]" in line for line in damaged)
    assert "newest readable epoch 2" in out and "stream 'main'" in out      # and went on
    assert main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "DAMAGED" in out and "Traceback" not in out + err
    assert sum(f"problem: epoch {e}:" in out for e in (deep, bad_entry)) == 2


def test_inspect_shows_the_names_a_person_recognises(tmp_path, capsys):
    path = tmp_path / "s"
    two_epochs(path, TEXT, RT)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model name: builtin:tiny" in out and "tokenizer name: cl100k_base" in out
    assert "max_context=1024" in out and "binding.model:" in out


def test_an_oversized_page_record_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "s"
    tokens = two_epochs(path, TEXT, RT)[1]
    # a 4 MiB host page: no page of this layout is above a KV block (a few KiB here)
    bad = forge(path, lambda m: m, pages=[("host/ids/main", 0, bytes(4 << 20))])
    with Session.open(path, device="cpu", runtime=RT) as s:
        most = s.checkpointer.snap.max_page_bytes()
        assert most < 1 << 20
        assert s.restored_epoch == 2 and s.tokens() == tokens
        [report] = s.restore_report
        assert f"epoch {bad}" in report and f"at most {most} bytes" in report


def test_a_manifest_too_big_to_read_back_is_never_written(tmp_path):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", runtime=RT) as s:
        s.append(TEXT)
        s.generate(2)
        s.checkpoint()
        s.state = {"log": "x" * MAX_MANIFEST_BYTES}
        with pytest.raises(ValueError, match="Session.state"):
            s.checkpoint()
        assert [e.id for e in s.epochs()] == [1]
        s.state = {"log": "short"}
        s.generate(2)
        assert s.checkpoint() == 2                      # the session goes on checkpointing
        tokens = s.tokens()
    with Session.open(path, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 2 and s.tokens() == tokens and s.state == {"log": "short"}
