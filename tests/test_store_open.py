"""Store.open: a failed open of a new store leaves nothing on disk; the LOCK's messages and races."""
from __future__ import annotations

import errno
import os
import sqlite3

import pytest

from capsule.errors import StoreError
from capsule.store import SigningKeyError, Store, StoreIOError, StoreLocked
from capsule.store import lockfile
from capsule.store.index import Index

KEY = b"k" * 32


def _disk_full(monkeypatch, where: str) -> type[Exception]:
    """Make one step of creating a store fail as a full disk does; returns the error Store.open raises."""
    if where == "lock pid":
        def pwrite(fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(lockfile.os, "pwrite", pwrite)
        return OSError

    def full(index, *args):   # SQLITE_FULL inside the step's transaction, as a full disk gives
        with index.transaction("initializing the store"):
            raise sqlite3.OperationalError("database or disk is full")
    # the schema step fails on an empty index file; the meta step after the schema is written
    monkeypatch.setattr(Index, "_create_schema" if where == "schema" else "init_meta", full)
    return StoreIOError


@pytest.mark.parametrize("where", ["lock pid", "schema", "meta"])
def test_failed_open_of_a_new_store_creates_nothing(tmp_path, monkeypatch, where):
    error = _disk_full(monkeypatch, where)
    with pytest.raises(error, match="No space left|disk is full"):
        Store.open(tmp_path / "a" / "b" / "s")
    assert os.listdir(tmp_path) == []   # no LOCK, no index, no segments/, no folders it made
    monkeypatch.undo()
    with Store.open(tmp_path / "a" / "b" / "s") as st:   # and the disk "freed": it opens
        assert st.write_epoch([("kv", 0, b"x")], b"{}").id == 1


@pytest.mark.parametrize("where", ["lock pid", "meta"])
def test_failed_open_in_an_existing_folder_keeps_the_folder_and_its_files(tmp_path, monkeypatch, where):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    error = _disk_full(monkeypatch, where)
    with pytest.raises(error):
        Store.open(folder)
    assert sorted(os.listdir(folder)) == ["notes.txt"]


def test_failed_open_of_an_existing_store_removes_nothing(tmp_path):
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        st.write_epoch([("kv", 0, b"x")], b"{}")
    before = sorted(os.listdir(tmp_path / "s"))
    with pytest.raises(SigningKeyError):
        Store.open(tmp_path / "s")
    assert sorted(os.listdir(tmp_path / "s")) == before and "LOCK" in before
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        assert st.latest_epoch() == 1


def test_open_without_create_leaves_an_empty_store_folder_as_it_was(tmp_path):
    (tmp_path / "s" / "segments").mkdir(parents=True)
    with pytest.raises(StoreError, match="no capsule store"):
        Store.open(tmp_path / "s", create=False)
    assert os.listdir(tmp_path / "s") == ["segments"]


def test_second_open_in_this_process_says_so(tmp_path):
    st = Store.open(tmp_path / "s")
    with pytest.raises(StoreLocked) as exc:
        Store.open(tmp_path / "s")
    msg = str(exc.value)
    assert "already open in this process: close the other Session (or Store) first" in msg
    assert "another process" not in msg
    st.close()
    Store.open(tmp_path / "s").close()
    assert lockfile._held == {}


def test_acquire_locks_the_file_a_failed_opener_replaced(tmp_path, monkeypatch):
    # between our open() of LOCK and our flock, a failed opener unlinks LOCK (and another makes a
    # new one): the lock we took is on a file nobody else will open, so acquire must retry
    path = tmp_path / "LOCK"
    path.write_bytes(b"")
    real_flock, calls = lockfile.fcntl.flock, []

    def flock(fd, op):
        calls.append(op)
        if len(calls) == 1:
            path.unlink()
            path.write_bytes(b"")
        return real_flock(fd, op)
    monkeypatch.setattr(lockfile.fcntl, "flock", flock)
    fd = lockfile.acquire(path)
    try:
        assert os.fstat(fd).st_ino == os.stat(path).st_ino and len(calls) == 2
        assert path.read_text() == f"{os.getpid()}\n"
    finally:
        lockfile.release(fd)
