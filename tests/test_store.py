"""capsule.store: round trips, durability, group commit, corruption handling, signing, limits."""
from __future__ import annotations

import array
import errno
import os
import sqlite3
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from capsule.errors import CapsuleCorrupt, StoreError
from capsule.store import (FileOps, PageCorrupt, SigningKeyError, Store, StoreIOError, StoreLocked,
                           UnknownEpoch)
from capsule.store.records import (KIND_PAGE, RECORD_HEADER, RecordError, Sealer, encode_record,
                                   parse_header)

SDK = str(Path(__file__).resolve().parents[1] / "sdk")
KEY = b"k" * 32


def page(e: int, region: str, i: int, n: int = 500) -> bytes:
    return (f"{e}/{region}/{i};".encode() * n)[:n]


def records(seg: Path) -> list[tuple[int, object, str]]:
    """(offset, header, region) of every record in a segment file."""
    data, out, off = seg.read_bytes(), [], 24
    while off < len(data):
        head = parse_header(data[off:off + RECORD_HEADER.size])
        name = data[off + RECORD_HEADER.size:off + RECORD_HEADER.size + head.name_len].decode()
        out.append((off, head, name))
        off += head.total
    return out


def segs(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def flip(file: Path, offset: int, mask: int = 0x5A) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


class Faulty(FileOps):
    """FileOps that fails chosen operations with chosen errnos (tests' power to break the disk)."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _maybe(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if op in self.fail:
            raise OSError(self.fail[op], os.strerror(self.fail[op]))

    def write(self, fd, data):
        self._maybe("write")
        return super().write(fd, data)

    def fsync(self, fd):
        self._maybe("fsync")
        return super().fsync(fd)

    def fsync_dir(self, path):
        self._maybe("fsync_dir")
        return super().fsync_dir(path)

    def truncate(self, fd, length):
        self._maybe("truncate")
        return super().truncate(fd, length)

    def unlink(self, path):
        self._maybe("unlink")
        return super().unlink(path)


# a reference model of delta epochs: the full view after each epoch
PLAN = {1: [("kv", 0), ("kv", 1), ("rng", 0)], 2: [("kv", 2), ("rng", 0)], 3: [("kv", 1), ("state", 7)],
        4: [], 5: [("kv", 3), ("rng", 0)]}


def write_plan(store: Store, upto: int = 5) -> dict[int, dict[str, dict[int, bytes]]]:
    views, cur = {}, {}
    for e in range(1, upto + 1):
        pages = [(r, i, page(e, r, i)) for r, i in PLAN[e]]
        info = store.write_epoch(pages, b'{"epoch": %d}' % e, name="home" if e == 2 else None, meta={"e": e})
        assert (info.id, info.n_pages, info.meta, info.base) == (e, len(pages), {"e": e}, e - 1)
        for r, i, data in pages:
            cur.setdefault(r, {})[i] = data
        views[e] = {r: dict(v) for r, v in cur.items()}
    return views


def test_round_trip_delta_views_names_resolve(tmp_path):
    with Store.open(tmp_path / "s", segment_bytes=4096) as st:
        assert st.latest_epoch() is None and st.load_newest_valid() is None and st.epochs() == []
        views = write_plan(st)
        for e, view in views.items():
            assert st.load_epoch(e) == (b'{"epoch": %d}' % e, view)
        assert [i.id for i in st.epochs()] == [1, 2, 3, 4, 5] and st.epochs()[1].name == "home"
        assert st.epochs()[0].bytes_written > 3 * 300
        assert st.resolve("home") == 2 and st.resolve(4) == 4 and st.resolve("4") == 4
        with pytest.raises(UnknownEpoch, match=r"epochs 1, 2, 3, 4, 5 \(named: 'home'\)") as exc:
            st.resolve("nope")
        assert isinstance(exc.value, KeyError) and isinstance(exc.value, StoreError)
        with pytest.raises(ValueError, match="already used"):
            st.write_epoch([], b"{}", name="home")
        assert len(segs(tmp_path / "s")) > 1  # rotation happened; views still merge across files
        assert st.verify().ok


def test_buffers_and_input_checks(tmp_path):
    with Store.open(tmp_path / "s") as st:
        floats = array.array("f", [1.5, 2.5, 3.5])
        st.write_epoch([("a", 0, memoryview(floats)), ("a", 1, bytearray(b"xy"))], memoryview(b"{}"))
        assert st.load_epoch(1)[1]["a"] == {0: floats.tobytes(), 1: b"xy"}
        bad = [([("a", 0, b"x"), ("a", 0, b"y")], "twice"), ([("", 0, b"x")], "non-empty"),
               ([("a", -1, b"x")], "index"), ([("a", True, b"x")], "index"), ([("a", 0, "str")], "bytes"),
               ([("a", 0)], "tuples")]
        for pages, msg in bad:
            with pytest.raises(ValueError, match=msg):
                st.write_epoch(pages, b"{}")
        with pytest.raises(ValueError, match="JSON"):
            st.write_epoch([], b"{}", meta={"x": object()})
        with pytest.raises(ValueError, match="epoch id"):
            st.write_epoch([], b"{}", name="12")
        assert st.latest_epoch() == 1  # nothing half-written by the rejected calls


def test_durable_across_reopen(tmp_path):
    with Store.open(tmp_path / "s") as st:
        views = write_plan(st)
    with Store.open(tmp_path / "s", create=False) as st:
        assert st.latest_epoch() == 5
        epoch, manifest, pages, skipped = st.load_newest_valid()
        assert (epoch, manifest, pages, skipped) == (5, b'{"epoch": 5}', views[5], [])
        assert st.write_epoch([("kv", 9, b"z")], b"{}").id == 6


def test_group_commit_one_fsync_for_many_epochs(tmp_path):
    fs = Faulty()
    with Store.open(tmp_path / "s", fs=fs) as st:
        ids = [st.stage_epoch([("kv", e, page(e, "kv", e))], b"m%d" % e) for e in range(1, 5)]
        assert ids == [1, 2, 3, 4] and st.latest_epoch() is None and st.epochs() == []
        before = fs.calls.get("fsync", 0)
        infos = st.sync()
        assert [i.id for i in infos] == ids and fs.calls["fsync"] - before == 1
        assert st.sync() == []
        assert st.load_epoch(4)[1]["kv"] == {e: page(e, "kv", e) for e in range(1, 5)}
        assert st.write_epoch([], b"m5").id == 5


def test_base_rewinds_the_view_without_rewriting_bytes(tmp_path):
    with Store.open(tmp_path / "s") as st:
        views = write_plan(st)
        info = st.write_epoch([("kv", 0, b"new")], b"{}", base=2)  # e.g. after rollback(2)
        expect = {r: dict(v) for r, v in views[2].items()}
        expect["kv"][0] = b"new"
        assert info.base == 2 and st.load_epoch(6)[1] == expect  # kv[3], state[7] of epochs 3..5 are gone
        assert st.write_epoch([("x", 0, b"1")], b"{}", base=0).id == 7
        assert st.load_epoch(7)[1] == {"x": {0: b"1"}}
        assert st.retain(2) == 4  # epochs 1, 3, 4, 5 (2 is named)
        assert st.load_epoch(6)[1] == expect and st.load_epoch(7)[1] == {"x": {0: b"1"}}
        assert st.load_epoch(2)[1] == views[2] and st.verify().ok
        with pytest.raises(UnknownEpoch):
            st.write_epoch([], b"{}", base=3)


def test_torn_tail_past_commit_is_cut(tmp_path):
    with Store.open(tmp_path / "s") as st:
        views = write_plan(st)
    seg = segs(tmp_path / "s")[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:  # a half-written record of an epoch that never committed
        f.write(encode_record(Sealer(None), KIND_PAGE, 6, "kv", 9, b"x" * 500)[0] + b"x" * 100)
    with Store.open(tmp_path / "s") as st:
        assert seg.stat().st_size == size
        assert st.load_newest_valid()[:3] == (5, b'{"epoch": 5}', views[5])
        assert st.write_epoch([("kv", 9, b"z")], b"{}").id == 6 and st.verify().ok


def test_torn_tail_into_committed_records_falls_back_or_raises(tmp_path):
    with Store.open(tmp_path / "s") as st:
        views = write_plan(st)
    seg = segs(tmp_path / "s")[-1]
    last = [off for off, head, _ in records(seg) if head.epoch == 5][0]
    os.truncate(seg, last + 10)  # cuts epoch 5's records: committed data lost behind the store's back
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(PageCorrupt, match="outside segment"):
            st.load_epoch(5)
        epoch, manifest, pages, skipped = st.load_newest_valid()
        assert (epoch, pages) == (4, views[4]) and len(skipped) == 1 and "epoch 5" in skipped[0]
        assert st.write_epoch([("kv", 0, b"after")], b"{}", base=4).id == 6  # goes to a fresh segment
        assert st.load_epoch(6)[1]["kv"][0] == b"after"
        report = st.verify()
        assert not report.ok and report.epochs_bad == (5,) and 6 in report.epochs_ok
    os.truncate(segs(tmp_path / "s")[0], 24)
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(CapsuleCorrupt, match="none is fully valid"):
            st.load_newest_valid()


@pytest.mark.parametrize("where", ["payload", "header", "manifest", "tag"])
def test_flipped_byte_is_detected_and_skipped(tmp_path, where):
    with Store.open(tmp_path / "s") as st:
        views = write_plan(st)
    seg = segs(tmp_path / "s")[0]
    recs = records(seg)
    if where == "manifest":
        off, head, _ = [(o, h, n) for o, h, n in recs if h.epoch == 5 and n == ""][0]
        target, want = off + head.total - 20, (5, None)
    else:  # state[7] was written by epoch 3 and is still seen by epochs 4 and 5
        off, head, _ = [(o, h, n) for o, h, n in recs if n == "state"][0]
        target = {"payload": off + RECORD_HEADER.size + 5 + 100, "header": off + 13,
                  "tag": off + head.total - 1}[where]
        want = (3, "state")
    flip(seg, target)
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(PageCorrupt) as exc:
            st.load_epoch(5)
        assert (exc.value.epoch, exc.value.region) == want and exc.value.segment == 1
        epoch, _, pages, skipped = st.load_newest_valid()
        expect = 4 if where == "manifest" else 2
        assert epoch == expect and pages == views[expect] and len(skipped) == 5 - expect
        assert not st.verify().ok


def test_damaged_index_is_never_an_empty_store(tmp_path):
    for damage in ("truncate", "garbage", "empty", "delete"):
        path = tmp_path / damage
        with Store.open(path) as st:
            views = write_plan(st)
        index = path / "index.sqlite"
        size = index.stat().st_size
        if damage == "truncate":
            os.truncate(index, size // 2)
        elif damage == "garbage":
            index.write_bytes(os.urandom(size))
        elif damage == "empty":
            os.truncate(index, 0)
        else:
            index.unlink()
        before = {p.name: p.read_bytes() for p in segs(path)}
        with Store.open(path) as st:   # the log is the truth: the index is rebuilt from it
            assert st.recovery_report and "rebuilt" in st.recovery_report[0]
            epoch, manifest, pages, skipped = st.load_newest_valid()
            assert (epoch, manifest, pages) == (5, b'{"epoch": 5}', views[5]) and skipped == []
            assert [i.name for i in st.epochs()] == [None, "home", None, None, None] and st.verify().ok
        assert {p.name: p.read_bytes() for p in segs(path)} == before     # not a byte of the log changed
        kept = list((path / "quarantine").glob("*-index/index.sqlite"))
        assert (len(kept) == 1) == (damage != "delete")                    # the old index is set aside
        with Store.open(path) as st:
            assert st.recovery_report == [] and st.latest_epoch() == 5


def test_lock_excludes_a_second_process(tmp_path):
    script = ("import sys, types; p = types.ModuleType('capsule'); p.__path__ = [sys.argv[1] + '/capsule']\n"
              "sys.modules['capsule'] = p\nfrom capsule.store import Store\n"
              "try:\n Store.open(sys.argv[2]).close(); print('opened')\n"
              "except Exception as e:\n print(type(e).__name__, e)")
    run = lambda: subprocess.run([sys.executable, "-c", script, SDK, str(tmp_path / "s")],  # noqa: E731
                                 capture_output=True, text=True, timeout=60).stdout
    st = Store.open(tmp_path / "s")
    out = run()
    assert out.startswith("StoreLocked") and "another process" in out and str(os.getpid()) in out
    with pytest.raises(StoreLocked):  # flock is per open file, so a second open in-process fails too
        Store.open(tmp_path / "s")
    st.close()
    assert run().strip() == "opened"


@pytest.mark.parametrize("op", ["write", "fsync", "fsync_dir"])
def test_enospc_and_eio_fail_cleanly_and_store_stays_usable(tmp_path, op):
    fs = Faulty()
    with Store.open(tmp_path / "s", fs=fs, segment_bytes=4096) as st:
        views = write_plan(st, 4)
        fs.fail[op] = errno.ENOSPC if op == "write" else errno.EIO
        done = 4
        with pytest.raises(StoreIOError, match="ENOSPC" if op == "write" else "EIO"):
            for _ in range(40):  # fsync_dir only runs when a segment file is created
                done = st.write_epoch([("kv", 50, b"q" * 1500)], b"{}").id
        assert st.latest_epoch() == done
        del fs.fail[op]
        assert st.write_epoch([("kv", 5, b"ok")], b"{}").id == done + 1
        assert st.load_epoch(4)[1] == views[4] and st.verify().ok
    with Store.open(tmp_path / "s") as st:
        assert st.latest_epoch() == done + 1 and st.load_newest_valid()[2]["kv"][5] == b"ok" and st.verify().ok
        assert st.recovery_report == []


def test_failed_sync_discards_staged_and_failed_cleanup_heals_later(tmp_path):
    fs = Faulty()
    with Store.open(tmp_path / "s", fs=fs) as st:
        write_plan(st, 2)
        assert [st.stage_epoch([], b"a"), st.stage_epoch([], b"b")] == [3, 4]
        fs.fail.update(fsync=errno.EIO, truncate=errno.EIO)
        with pytest.raises(StoreIOError, match=r"\[3, 4\] were not committed.*retried"):
            st.sync()
        with pytest.raises(StoreIOError, match="still cannot cut"):
            st.write_epoch([], b"c")
        fs.fail.clear()
        assert st.write_epoch([("kv", 0, b"c")], b"c").id == 3 and st.verify().ok


def test_permissions(tmp_path):
    with Store.open(tmp_path / "s") as st:
        write_plan(st, 2)
        mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
        assert mode(tmp_path / "s") == 0o700 and mode(tmp_path / "s" / "segments") == 0o700
        files = [p for p in (tmp_path / "s").rglob("*") if p.is_file()]
        assert len(files) >= 4 and all(mode(p) == 0o600 for p in files), [(p.name, oct(mode(p))) for p in files]
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="regular file"):
        Store.open(tmp_path / "file")
    with pytest.raises(StoreError, match="no capsule store"):
        Store.open(tmp_path / "missing", create=False)


def test_lengths_from_disk_are_bounds_checked(tmp_path):
    with pytest.raises(RecordError, match="exceeds"):
        parse_header(struct.pack("<4sHBBQQHQ", b"CREC", 1, 1, 1, 1, 0, 1, 1 << 60))
    with Store.open(tmp_path / "s") as st:
        views = write_plan(st, 2)
    seg = segs(tmp_path / "s")[0]
    off = [o for o, h, _ in records(seg) if h.epoch == 2][0]
    with open(seg, "r+b") as f:  # claim a 2**60-byte payload in epoch 2's first record
        f.seek(off + RECORD_HEADER.size - 8)
        f.write(struct.pack("<Q", 1 << 60))
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(PageCorrupt, match="exceeds"):
            st.load_epoch(2)
        assert any("exceeds" in p for p in st.verify().problems)
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    con.execute("UPDATE pages SET length = ? WHERE epoch = 1", (1 << 60,))
    con.commit()
    con.close()
    with Store.open(tmp_path / "s") as st:   # an impossible row is index damage: rebuilt from the log
        assert st.load_epoch(1)[1] == views[1]
        assert any("rebuilt" in line and "pages.length" not in line and "length holds" in line
                   for line in st.recovery_report), st.recovery_report


def test_signed_store(tmp_path):
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        views = write_plan(st)
    for key, msg in [(None, "is signed"), (b"w" * 32, "not the key")]:
        with pytest.raises(SigningKeyError, match=msg):
            Store.open(tmp_path / "s", sign_key=key)
    with Store.open(tmp_path / "u") as st:
        st.write_epoch([], b"{}")
    with pytest.raises(SigningKeyError, match="without signing"):
        Store.open(tmp_path / "u", sign_key=KEY)
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        assert st.load_newest_valid()[2] == views[5] and st.verify().ok
    # an attacker without the key rewrites kv[3] of epoch 5 with a valid xxh3 tag and fixes the index
    seg = segs(tmp_path / "s")[0]
    off, head, _ = [(o, h, n) for o, h, n in records(seg) if n == "kv" and h.index == 3][0]
    forged = b"".join(encode_record(Sealer(None), KIND_PAGE, 5, "kv", 3, b"E" * head.payload_len))
    with open(seg, "r+b") as f:
        f.seek(off)
        f.write(forged)
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    con.execute("UPDATE pages SET length = ? WHERE region = 'kv' AND idx = 3", (len(forged),))
    con.commit()
    con.close()
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        with pytest.raises(PageCorrupt, match="not signed"):
            st.load_epoch(5)
        assert st.load_newest_valid()[0] == 4


def test_reader_thread_alongside_writer(tmp_path):
    errors: list[BaseException] = []
    with Store.open(tmp_path / "s", segment_bytes=8192) as st:
        def read() -> None:
            try:
                for _ in range(200):
                    latest = st.latest_epoch()
                    if latest:
                        _, pages = st.load_epoch(latest)
                        assert pages["kv"] == {i: page(i + 1, "kv", i) for i in range(latest)}
            except BaseException as exc:  # surfaced below
                errors.append(exc)
        reader = threading.Thread(target=read)
        reader.start()
        for e in range(1, 60):
            st.write_epoch([("kv", e - 1, page(e, "kv", e - 1))], b"{}")
            if e % 10 == 0:
                st.retain(3)
                st.compact()
        reader.join()
    assert not errors, errors[0]


def test_close_discards_unsynced_staged_epochs(tmp_path):
    with Store.open(tmp_path / "s") as st:
        write_plan(st, 2)
        assert st.stage_epoch([("kv", 9, b"x")], b"{}") == 3
    with Store.open(tmp_path / "s") as st:
        assert st.latest_epoch() == 2 and st.stage_epoch([], b"{}") == 3 and [i.id for i in st.sync()] == [3]


KEYS = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
OPS = hs.lists(hs.one_of(
    hs.tuples(hs.just("write"), hs.lists(hs.sampled_from(KEYS), unique=True, max_size=4),
              hs.one_of(hs.none(), hs.integers(0, 6)), hs.booleans()),
    hs.tuples(hs.just("retain"), hs.integers(1, 3)),
    hs.tuples(hs.just("compact")),
    hs.tuples(hs.just("reopen"))), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_views_match_a_model_under_rewinds_retention_and_compaction(tmp_path_factory, ops):
    """Every retained epoch's view equals a plain dict model, whatever writes (with older bases),
    retention, compaction and reopening happened in between."""
    path = tmp_path_factory.mktemp("model") / "s"
    model: dict[int, dict[tuple[str, int], bytes]] = {}
    named: set[int] = set()
    store = Store.open(path, segment_bytes=4096)
    try:
        for op in ops:
            if op[0] == "write":
                _, keys, pick, name = op
                latest = max(model, default=0)
                base = None if pick is None or not model else ([0] + sorted(model))[pick % (len(model) + 1)]
                pages = [(r, i, page(latest + 1, r, i, 200)) for r, i in keys]
                view = dict(model.get(latest if base is None else base, {}))
                view.update({(r, i): d for r, i, d in pages})
                info = store.write_epoch(pages, b"m", name=f"n{latest + 1}" if name else None, base=base)
                assert info.id == latest + 1
                model[info.id] = view
                named |= {info.id} if name else set()
            elif op[0] == "retain":
                ids = sorted(model)
                drop = [e for e in ids[:-op[1]] if e not in named]
                assert store.retain(op[1]) == len(drop)
                for e in drop:
                    del model[e]
            elif op[0] == "compact":
                store.compact()
            else:
                store.close()
                store = Store.open(path, segment_bytes=4096)
            assert [i.id for i in store.epochs()] == sorted(model)
            for e, view in model.items():
                got = store.load_epoch(e)[1]
                assert {(r, i): d for r, v in got.items() for i, d in v.items()} == view, e
        assert store.verify().ok
    finally:
        store.close()
