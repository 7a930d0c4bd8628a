"""A store folder with hostile entries: links out of it, FIFOs, folders, sockets where the store
keeps regular files; a power cut or a full disk during a new store's first open.

The store never writes, truncates or deletes anything outside its folder, never blocks, and fails
typed (UnsafeStore, PageCorrupt, StoreError); a store cut short while being created opens again.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import capsule
from capsule.errors import CapsuleError, StoreError
from capsule.store import FileOps, PageCorrupt, Store, StoreIOError, UnsafeStore

LINK = ("is a symbolic link; the store never follows links out of its folder: replace it with the real "
        "file or move the folder away")
SDK = str(Path(capsule.__file__).resolve().parents[1])


def make_store(path: Path, epochs: int = 5) -> None:
    """A closed store, epoch e in segment file e: one page kv[0] of 3000 bytes each, so an epoch's
    view uses its own segment only."""
    with Store.open(path, segment_bytes=4096) as st:
        for e in range(epochs):
            st.write_epoch([("kv", 0, bytes([e]) * 3000)], b"{}")


def segments(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def fingerprint(path: Path) -> dict[str, tuple]:
    """Every file under path (or path itself): sha256, size, mtime; folders: their listing and mtime."""
    out = {}
    for p in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
        st = os.lstat(p)
        if p.is_dir():
            out[str(p)] = ("dir", sorted(os.listdir(p)), st.st_mtime_ns)
        else:
            out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
    return out


def within(seconds: float, fn, *fifos: Path):
    """fn() run in a thread; fails if it blocks longer than `seconds` (then a writer is opened on
    each FIFO, so a reader stuck on one is released and the thread ends)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"blocked for more than {seconds} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


# -- 1. links ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["LOCK", "active segment", "sealed segment", "index.sqlite",
                                   "index.sqlite-wal", "index.sqlite-shm", "index.sqlite-journal"])
def test_a_link_inside_the_store_is_refused_and_its_target_is_untouched(tmp_path, entry):
    store = tmp_path / "store"
    make_store(store)
    target = {"active segment": segments(store)[-1], "sealed segment": segments(store)[0]}.get(
        entry, store / entry)
    outside = tmp_path / "outside" / target.name
    outside.parent.mkdir()
    if target.exists():
        shutil.copy2(target, outside)   # a copy, so the store would find what it expects there
        target.unlink()
    else:
        outside.write_bytes(os.urandom(5000))
    os.symlink(outside, target)
    before = fingerprint(outside)
    with pytest.raises(UnsafeStore) as exc:
        Store.open(store)
    assert f"{target} {LINK}" in str(exc.value)
    assert isinstance(exc.value, StoreError) and isinstance(exc.value, capsule.CapsuleError)
    assert fingerprint(outside) == before
    assert os.path.islink(target)   # the link itself is left for the user to look at


def test_segments_folder_that_is_a_link_is_refused_and_the_folder_it_points_at_is_untouched(tmp_path):
    store = tmp_path / "store"
    make_store(store)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store / "segments", elsewhere)
    with open(elsewhere / segments(store)[-1].name, "ab") as f:
        f.write(b"torn tail the store would cut")   # bytes past the committed end
    (elsewhere / "999999.seg").write_bytes(b"an uncommitted file the store would delete")
    shutil.rmtree(store / "segments")
    os.symlink(elsewhere, store / "segments")
    before = fingerprint(elsewhere)
    with pytest.raises(UnsafeStore, match="segments is a symbolic link; the store never follows"):
        Store.open(store)
    assert fingerprint(elsewhere) == before


def test_a_link_to_a_dead_index_is_refused_not_taken_for_a_new_store(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    os.symlink(tmp_path / "nowhere.sqlite", store / "index.sqlite")
    with pytest.raises(UnsafeStore, match=LINK):
        Store.open(store)
    assert not (tmp_path / "nowhere.sqlite").exists()
    assert sorted(os.listdir(store)) == ["index.sqlite"]


def test_the_store_folder_itself_may_be_a_link(tmp_path):
    real = tmp_path / "mnt" / "sd" / "robot"
    real.parent.mkdir(parents=True)
    make_store(real, epochs=2)
    os.symlink(real, tmp_path / "robot")
    with Store.open(tmp_path / "robot", segment_bytes=4096) as st:
        assert st.latest_epoch() == 2
        st.write_epoch([("kv", 9, b"via the link")], b"{}")
    with Store.open(real) as st:
        assert st.load_epoch(3)[1]["kv"][9] == b"via the link"


def test_a_folder_name_with_uri_characters_is_the_folder_sqlite_opens(tmp_path):
    store = tmp_path / "robot ?mode=ro#x%41 é"   # nofollow URI: every character percent-encoded
    make_store(store, epochs=1)
    with Store.open(store) as st:
        assert st.latest_epoch() == 1
    assert sorted(os.listdir(tmp_path)) == [store.name]
    assert sorted(os.listdir(store)) == ["LOCK", "index.sqlite", "segments"]


def test_a_store_link_to_a_missing_folder_creates_nothing(tmp_path):
    os.symlink(tmp_path / "sd" / "robot", tmp_path / "robot")   # the SD card is not mounted
    with pytest.raises(StoreError, match="which does not exist"):
        Store.open(tmp_path / "robot")
    assert not (tmp_path / "sd").exists()


# -- 2, 3. FIFOs, folders, sockets ----------------------------------------------------------------
def _replace(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()


@pytest.mark.parametrize("kind", ["fifo", "folder", "socket"])
@pytest.mark.parametrize("where", ["active", "next"])
def test_no_regular_file_where_the_writer_appends_refuses_the_open(tmp_path, kind, where):
    store = tmp_path / "store"
    make_store(store)
    top = segments(store)[-1]
    path = top if where == "active" else top.with_name(f"{int(top.stem) + 1:06d}.seg")
    _replace(path, kind)
    words = {"fifo": "a FIFO (named pipe)", "folder": "a directory", "socket": "a socket"}[kind]
    with pytest.raises(UnsafeStore, match=re.escape(f"{path.name} is {words}, not a regular file")):
        within(10, lambda: Store.open(store), path)


@pytest.mark.parametrize("kind", ["fifo", "folder", "socket"])
def test_no_regular_file_in_place_of_a_sealed_segment_reads_as_damage(tmp_path, kind):
    store = tmp_path / "store"
    make_store(store)
    first = segments(store)[0]
    with Store.open(store) as st:
        _replace(first, kind)     # before the first read, as a swap while the store is open would
        with pytest.raises(PageCorrupt, match=f"{first.name} cannot be read"):
            within(10, lambda: st.load_epoch(1), first)
        report = within(10, st.verify, first)
        assert not report.ok and 1 in report.epochs_bad
        assert any(f"{first.name} cannot be read" in p for p in report.problems)
        assert within(10, st.load_newest_valid, first)[0] == 5
    with Store.open(store) as st:  # and the store opens with it there (only the writer's file must not be)
        assert within(10, st.load_newest_valid, first)[0] == 5
        st.write_epoch([("kv", 0, b"still writable")], b"{}")


def test_a_fifo_swapped_in_for_the_active_segment_of_an_open_store_never_blocks(tmp_path):
    store = tmp_path / "store"
    make_store(store)
    top = segments(store)[-1]
    with Store.open(store) as st:
        _replace(top, "fifo")
        with pytest.raises(UnsafeStore, match=re.escape(f"{top} is a FIFO")):
            within(10, st.verify, top)
        epoch, _, _, skipped = within(10, st.load_newest_valid, top)
        assert epoch == 4 and f"{top.name} cannot be read" in skipped[0]
        with pytest.raises(StoreError):   # the next epoch's base (epoch 5) cannot be read
            within(10, lambda: st.write_epoch([("kv", 0, b"x")], b"{}"), top)


def test_a_fifo_as_lock_or_index_is_refused_without_blocking(tmp_path):
    for name in ("LOCK", "index.sqlite", "index.sqlite-wal"):
        store = tmp_path / name
        make_store(store, epochs=1)
        _replace(store / name, "fifo")
        with pytest.raises(UnsafeStore, match=f"{name} is a FIFO"):
            within(10, lambda: Store.open(store), store / name)


# -- 4. a power cut during a new store's first open -------------------------------------------------
# a first transaction cut short once its journal is synced and the file written (a cache spill)
CAPTURE = r"""
import os, signal, sqlite3, sys
db = sys.argv[1]
conn = sqlite3.connect(db, isolation_level=None)
conn.execute("PRAGMA cache_size=1")
conn.execute("BEGIN")
def cut():
    if os.path.exists(db + "-journal") and os.path.getsize(db) > 0:
        os.kill(os.getpid(), signal.SIGKILL)
conn.set_progress_handler(cut, 100)
for i in range(100000):
    conn.execute(f"CREATE TABLE t{i}(x TEXT)")
    conn.execute(f"INSERT INTO t{i} VALUES (?)", ("x" * 3000,))
"""


def torn_first_transaction(tmp_path: Path) -> tuple[bytes, bytes]:
    """(a database file torn at 512 bytes, its hot journal) as a power cut leaves them during the
    first transaction of a new database (switching it to WAL, as the store's first open does)."""
    folder = tmp_path / "capture"
    folder.mkdir()
    (folder / "cut.sqlite").touch()
    run = subprocess.run([sys.executable, "-c", CAPTURE, str(folder / "cut.sqlite")], timeout=60)
    assert run.returncode == -signal.SIGKILL
    journal = (folder / "cut.sqlite-journal").read_bytes()  # a new database's: no page images, size 0
    (folder / "new.sqlite").touch()
    with contextlib.closing(sqlite3.connect(folder / "new.sqlite", isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL").fetchall()   # the page 1 that commit was writing
    return (folder / "new.sqlite").read_bytes()[:512], journal


def test_a_hot_journal_over_a_torn_new_index_is_rolled_back_and_the_store_opens(tmp_path):
    head, journal = torn_first_transaction(tmp_path)
    store = tmp_path / "store"
    Store.open(store).close()
    (store / "index.sqlite").write_bytes(head)   # SQLite's first write torn at 512 bytes
    (store / "index.sqlite-journal").write_bytes(journal)
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    with sqlite3.connect(copy / "index.sqlite") as conn:   # plain SQLite rolls it back
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    with Store.open(store) as st:                # and so does the store: an empty store again
        assert st.latest_epoch() is None
        st.write_epoch([("kv", 0, b"after the power cut")], b"{}")
    assert not (store / "index.sqlite-journal").exists()
    with Store.open(store) as st:
        assert st.load_epoch(1)[1]["kv"][0] == b"after the power cut"


def test_a_creation_cut_short_leaves_only_a_temporary_file_which_the_next_open_removes(tmp_path):
    store = tmp_path / "store"
    cut = ("import os, signal, sys\nfrom capsule.store import Store\nfrom capsule.store.index import Index\n"
           "def schema(self):\n"
           "    assert not os.path.exists(sys.argv[1] + '/index.sqlite'), 'built in place'\n"
           "    original(self)\n"
           "    os.kill(os.getpid(), signal.SIGKILL)\n"
           "original, Index._create_schema = Index._create_schema, schema\n"
           "Store.open(sys.argv[1])\n")
    run = subprocess.run([sys.executable, "-c", cut, str(store)], timeout=120,
                         env={**os.environ, "PYTHONPATH": SDK})
    assert run.returncode == -signal.SIGKILL
    assert "index.sqlite.new" in os.listdir(store) and "index.sqlite" not in os.listdir(store)
    with Store.open(store) as st:
        assert st.latest_epoch() is None
        st.write_epoch([("kv", 0, b"x")], b"{}")
    assert "index.sqlite.new" not in os.listdir(store)
    assert oct(os.stat(store / "index.sqlite").st_mode & 0o777) == "0o600"


def test_a_failed_rename_of_the_new_index_leaves_nothing(tmp_path, monkeypatch):
    from capsule.store import fsafe

    def rename(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(fsafe.os, "rename", rename)
    with pytest.raises(StoreIOError, match="creating the index .* failed"):
        Store.open(tmp_path / "s")
    assert os.listdir(tmp_path) == []


# -- 5. a full disk during the first open ------------------------------------------------------------
FULL_AT_META = r"""
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG) as on a full disk
from capsule.store import Store
from capsule.store.index import Index
original, limit = Index.init_meta, None
def init_meta(self, values):                    # the disk fills up once the schema is committed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    original(self, values)
Index.init_meta = init_meta
for folder in sys.argv[1:]:
    limit = int(Path(folder).name[1:])
    try:
        Store.open(folder).close()
    except Exception as exc:
        print(type(exc).__name__, exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""


def test_a_full_disk_during_the_first_open_never_leaves_a_truncated_index(tmp_path):
    """Seen once: IndexCorrupt 'truncated (12288 bytes, header says 20 pages of 4096)' after a full
    disk. Cause: the failed open of a new store in a folder holding an empty index.sqlite kept that
    file, which the close's checkpoint had half written, and removed its -wal."""
    stores = [tmp_path / f"s{limit}" for limit in (4096, 12288, 40960)]
    for store in stores:
        store.mkdir()
        (store / "index.sqlite").touch()   # as an earlier open cut short leaves it
    subprocess.run([sys.executable, "-c", FULL_AT_META, *map(str, stores)], timeout=120,
                   env={**os.environ, "PYTHONPATH": SDK}, check=True)
    for store in stores:
        with Store.open(store) as st:     # the disk has room again
            st.write_epoch([("kv", 0, b"x")], b"{}")
        with Store.open(store) as st:
            assert st.load_epoch(1)[1]["kv"][0] == b"x"


class FullDisk(FileOps):
    """Segment writes fail with ENOSPC once `room` bytes were written."""

    def __init__(self, room: int) -> None:
        self.room = room

    def write(self, fd, data):
        self.room -= len(memoryview(data).cast("B"))
        if self.room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(fd, data)


def test_enospc_through_fileops_then_reopen_keeps_every_acknowledged_epoch(tmp_path):
    store = tmp_path / "s"
    store.mkdir()
    (store / "index.sqlite").touch()     # as left by an earlier open cut short
    acked = []
    with Store.open(store, fs=FullDisk(40_000), segment_bytes=8192) as st:
        with pytest.raises(StoreIOError, match="No space left"):
            for e in range(1, 100):
                st.write_epoch([("kv", e % 3, os.urandom(2500))], b"{}")
                acked.append(e)
    with Store.open(store) as st:
        assert st.verify().ok and st.latest_epoch() == acked[-1]
        st.write_epoch([("kv", 0, b"room again")], b"{}")


MNT_ROOM_KB = range(4, 300, 4)   # KiB left free: the window where only the meta write fails is narrow


def test_a_full_tmpfs_during_the_first_open_never_leaves_an_unopenable_store(tmp_path):
    """The same on a real full filesystem (a 1 MiB tmpfs; needs permission to mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    failures = []
    for room_kb in MNT_ROOM_KB:
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                           check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot mount a tmpfs here: {exc}")
        try:
            store = mnt / "s"
            store.mkdir()
            (store / "index.sqlite").touch()
            vfs = os.statvfs(mnt)
            (mnt / "filler").write_bytes(b"\0" * max(0, vfs.f_bavail * vfs.f_bsize - room_kb * 1024))
            try:
                Store.open(store).close()
            except StoreIOError:
                pass   # the disk is full: expected; what matters is the reopen
            (mnt / "filler").unlink()
            try:
                with Store.open(store) as st:
                    st.write_epoch([("kv", 0, b"x")], b"{}")
            except CapsuleError as exc:
                failures.append(f"{room_kb} KiB free: {type(exc).__name__}: {exc}")
        finally:
            subprocess.run(["umount", str(mnt)], check=True, timeout=30)
    assert failures == []


def test_an_index_header_with_a_damaged_format_version_is_rebuilt_not_opened_read_only(tmp_path):
    store = tmp_path / "store"
    make_store(store, epochs=2)
    with open(store / "index.sqlite", "r+b") as f:   # byte 18: the write version (1 or 2)
        f.seek(18)
        f.write(b"\x0a")
    with Store.open(store) as st:   # SQLite would open it read-only: every commit would fail
        assert st.latest_epoch() == 2
        st.write_epoch([("kv", 0, b"writable")], b"{}")
