"""`capsule inspect` / `capsule verify` on awkward stores: signed, empty, read-only."""
from __future__ import annotations

import errno
import os

import pytest

from capsule.cli import main
from capsule.store import Store, lockfile

KEY = b"k" * 32
VERBS = ["inspect", "verify", "repair"]


@pytest.fixture(autouse=True)
def _no_key_env(monkeypatch):
    monkeypatch.delenv("CAPSULE_SIGN_KEY_FILE", raising=False)


def _store(path, key=None):
    with Store.open(path, sign_key=key) as st:
        st.write_epoch([("kv", 0, b"page")], b'{"host": {"streams": []}}', name="start")
    return path


def _key_file(path, data=KEY, mode=0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def _err_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("verb", VERBS)
def test_signed_store_opens_with_the_key_file(verb, tmp_path, capsys):
    store = _store(tmp_path / "s", KEY)
    assert main([verb, str(store), "--sign-key-file", str(_key_file(tmp_path / "key"))]) == 0
    assert {"inspect": "1 epoch(s)", "verify": "OK", "repair": "verify: ok"}[verb] in capsys.readouterr().out


@pytest.mark.parametrize("verb", VERBS)
def test_key_file_from_the_environment_and_the_option_wins(verb, tmp_path, monkeypatch, capsys):
    store = _store(tmp_path / "s", KEY)
    monkeypatch.setenv("CAPSULE_SIGN_KEY_FILE", str(_key_file(tmp_path / "key")))
    assert main([verb, str(store)]) == 0
    capsys.readouterr()
    wrong = _key_file(tmp_path / "wrong", b"w" * 32)
    assert main([verb, str(store), "--sign-key-file", str(wrong)]) == 1
    err = _err_line(capsys)
    assert "not the key" in err and f"the key came from --sign-key-file {wrong}" in err


@pytest.mark.parametrize("verb", VERBS)
def test_missing_or_wrong_key_is_a_one_line_signing_error(verb, tmp_path, capsys):
    store = _store(tmp_path / "s", KEY)
    assert main([verb, str(store)]) == 1
    err = _err_line(capsys)
    assert "is signed" in err and "--sign-key-file PATH" in err and "CAPSULE_SIGN_KEY_FILE" in err
    assert main([verb, str(store), "--sign-key-file", str(_key_file(tmp_path / "w", b"w" * 32))]) == 1
    assert "not the key" in _err_line(capsys)
    unsigned = _store(tmp_path / "u")
    assert main([verb, str(unsigned), "--sign-key-file", str(tmp_path / "w")]) == 1
    assert "created without signing" in _err_line(capsys)


@pytest.mark.parametrize("data, mode, fragment", [
    (b"", 0o600, "is empty"),
    (b"short", 0o600, "holds 5 bytes; a signing key is at least 16"),
    (KEY, 0o644, "chmod 600"),
    (KEY, 0o602, "chmod 600"),
])
def test_bad_key_files_are_refused(data, mode, fragment, tmp_path, capsys):
    store = _store(tmp_path / "s", KEY)
    assert main(["inspect", str(store), "--sign-key-file", str(_key_file(tmp_path / "key", data, mode))]) == 1
    assert fragment in _err_line(capsys)


def test_unreadable_key_file_is_a_one_line_error(tmp_path, capsys):
    store = _store(tmp_path / "s", KEY)
    assert main(["verify", str(store), "--sign-key-file", str(tmp_path / "nope")]) == 1
    err = _err_line(capsys)
    assert "cannot read the signing key file" in err and "No such file" in err


@pytest.mark.parametrize("verb", VERBS)
def test_empty_folder_holds_no_store_and_stays_empty(verb, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([verb, str(tmp_path / "empty")]) == 1
    err = _err_line(capsys)
    assert "holds no capsule store" in err and "create=True" not in err
    assert os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize("verb", VERBS)
def test_read_only_filesystem_is_a_one_line_error(verb, tmp_path, monkeypatch, capsys):
    store = _store(tmp_path / "s")

    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(lockfile, "acquire", read_only)   # os.open of LOCK fails so on a read-only disk
    assert main([verb, str(store)]) == 1
    err = _err_line(capsys)
    assert "Read-only file system" in err and "write access" in err


def test_an_oserror_past_opening_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    store = _store(tmp_path / "s")

    def eio(self):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(Store, "verify", eio)
    assert main(["verify", str(store)]) == 1
    assert "Input/output error" in _err_line(capsys)


def test_repair_rebuilds_a_damaged_index_from_the_log(tmp_path, capsys):
    path = _store(tmp_path / "s")
    with Store.open(path) as st:
        st.write_epoch([("kv", 1, b"more")], b'{"host": {"streams": []}}')
    (path / "index.sqlite").write_bytes(b"garbage" * 100)
    assert main(["repair", str(path)]) == 0
    out = capsys.readouterr().out
    assert "index rebuilt from the segment log" in out and "2 epochs (1, 2)" in out and "verify: ok" in out
    with Store.open(path) as st:
        assert st.resolve("start") == 1 and st.load_epoch(2)[1] == {"kv": {0: b"page", 1: b"more"}}
    assert list((path / "quarantine").glob("*-index/index.sqlite"))     # the old index is kept
    assert main(["inspect", str(path)]) == 0
    assert "quarantine/: 1 folder(s) recovery set aside" in capsys.readouterr().out
