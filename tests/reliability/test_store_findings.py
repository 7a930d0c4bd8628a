"""Regression tests for the store findings of issue 11 (the index is a cache of the log).

Each test is the finding's recipe: a store that checkpointed a dozen epochs, then damaged as the
finding says. The contract: the newest acknowledged epoch comes back bit-exactly (the index is
rebuilt from the segment log), no segment byte is deleted or changed, and every failure is typed.
"""
from __future__ import annotations

import hashlib
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest

from capsule.errors import CapsuleError
from capsule.store import Store

from test_memory_facts import sql

KEY_A, KEY_B = b"a" * 32, b"b" * 32
N = 12


def content(e: int, region: str, i: int) -> bytes:
    return hashlib.sha256(f"{e}/{region}/{i}".encode()).digest() * 20


def pages_for(e: int) -> list[tuple[str, int, bytes]]:
    return [("kv", e - 1, content(e, "kv", e - 1)), ("state", e % 3, content(e, "state", e % 3)),
            ("rng", 0, content(e, "rng", 0))]


def view(epoch: int) -> dict[str, dict[int, bytes]]:
    out: dict[str, dict[int, bytes]] = {}
    for e in range(1, epoch + 1):
        for region, i, data in pages_for(e):
            out.setdefault(region, {})[i] = data
    return out


def build(path: Path, key: bytes | None = None, n: int = N, image: Path | None = None) -> None:
    """n epochs; image: also copy the folder while the store is still open (a power-cut image)."""
    with Store.open(path, sign_key=key) as st:
        for e in range(1, n + 1):
            st.write_epoch(pages_for(e), b'{"epoch": %d}' % e, meta={"e": e})
        if image is not None:
            shutil.copytree(path, image)


def log_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((path / "segments").glob("*.seg"))}


def check_exact(path: Path, key: bytes | None = None, newest: int = N) -> Store:
    st = Store.open(path, sign_key=key)
    found = st.load_newest_valid()
    assert found is not None, "nothing restored while acknowledged epochs exist"
    epoch, manifest, pages, _ = found
    assert (epoch, manifest) == (newest, b'{"epoch": %d}' % newest)
    assert {r: {i: bytes(b) for i, b in p.items()} for r, p in pages.items()} == view(newest)
    return st


def wal_frames(wal: Path) -> list[int]:
    """Offsets of the WAL's frames (32-byte header, then 24-byte frame header + page each)."""
    data = wal.read_bytes()
    page = struct.unpack(">I", data[8:12])[0]
    return list(range(32, len(data) - 24 - page + 1, 24 + page))


# -- finding 1: a flipped bit in the WAL ------------------------------------------------------------
@pytest.mark.parametrize("where", ["first", "middle", "last", "cut"])
def test_damaged_wal_never_deletes_the_log_nor_restores_an_older_epoch(tmp_path, where):
    build(tmp_path / "live", image=tmp_path / "img")
    img = tmp_path / "img"
    frames = wal_frames(img / "index.sqlite-wal")
    assert len(frames) > 8, "the image must hold the epochs' transactions in its WAL"
    at = {"first": frames[3], "middle": frames[len(frames) // 2], "last": frames[-1], "cut": frames[4]}[where]
    wal = bytearray((img / "index.sqlite-wal").read_bytes())
    if where == "cut":
        del wal[at + 100:]
    else:
        wal[at + 24 + 200] ^= 0x10
    (img / "index.sqlite-wal").write_bytes(bytes(wal))
    before = log_bytes(img)
    with check_exact(img) as st:
        assert st.verify().ok
        st.write_epoch(pages_for(N + 1), b'{"epoch": %d}' % (N + 1))
    after = log_bytes(img)
    assert all(after[name].startswith(data) for name, data in before.items()), "a log byte changed or was cut"


# -- finding 2: swapped pages of index.sqlite --------------------------------------------------------
def test_swapped_index_pages_rebuild_the_index(tmp_path):
    build(tmp_path / "s")
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'epochs'").fetchone()[0]
    other = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'segments'").fetchone()[0]
    con.close()
    data = bytearray((tmp_path / "s" / "index.sqlite").read_bytes())
    a, b = (root - 1) * 4096, (other - 1) * 4096
    data[a:a + 4096], data[b:b + 4096] = data[b:b + 4096], data[a:a + 4096]
    (tmp_path / "s" / "index.sqlite").write_bytes(bytes(data))
    before = log_bytes(tmp_path / "s")
    with check_exact(tmp_path / "s") as st:
        assert st.write_epoch(pages_for(N + 1), b"{}").id == N + 1      # no UNIQUE constraint error
    assert log_bytes(tmp_path / "s")["000001.seg"].startswith(before["000001.seg"])


# -- finding 3: a flipped bit in sqlite_master's text -------------------------------------------------
def test_damaged_schema_text_is_typed_and_rebuilt(tmp_path):
    build(tmp_path / "s")
    data = bytearray((tmp_path / "s" / "index.sqlite").read_bytes())
    at = data.index(b"CREATE TABLE", 0, 4096)
    data[at + 3] ^= 0x80                                 # not UTF-8 any more
    (tmp_path / "s" / "index.sqlite").write_bytes(bytes(data))
    with check_exact(tmp_path / "s") as st:
        assert st.recovery_report and "rebuilt" in st.recovery_report[0]


# -- finding 4: a damaged epochs.meta ---------------------------------------------------------------
@pytest.mark.parametrize("meta", ["{not json", "[" * 200_000 + "]" * 200_000, "[1, 2]", "NaN", "\"x\""])
def test_damaged_epoch_meta_never_escapes(tmp_path, meta):
    build(tmp_path / "s")
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    con.execute("UPDATE epochs SET meta = ? WHERE id = 5", (meta,))
    con.commit()
    con.close()
    with check_exact(tmp_path / "s") as st:
        infos = st.epochs()
        assert [i.id for i in infos] == list(range(1, N + 1)) and infos[4].meta == {"e": 5}
        st.write_epoch(pages_for(N + 1), b"{}")
        assert st.retain(4) == N + 1 - 4                 # retention reads every meta: no error after commit


# -- finding 5: an edited page row ----------------------------------------------------------------
@pytest.mark.parametrize("edit", ["relabel", "delete", "repoint"])
def test_edited_page_rows_never_restore_wrong_bytes(tmp_path, edit):
    build(tmp_path / "s")
    row = f"(SELECT rowid FROM pages WHERE epoch = {N} AND region = 'rng')"
    sql(tmp_path / "s", {
        "relabel": f"UPDATE pages SET epoch = {N - 1} WHERE region = 'kv' AND epoch = {N}",
        "delete": f"DELETE FROM pages WHERE rowid = {row}",
        # point the newest rng page at an older record of the same page (it verifies by itself)
        "repoint": f"UPDATE pages SET (rec_epoch, segment, offset, length) = (SELECT rec_epoch, segment, offset, "
                   f"length FROM pages WHERE region = 'rng' AND epoch = 3) WHERE rowid = {row}",
    }[edit])
    with Store.open(tmp_path / "s") as st:                     # verify only looks, and says so
        report = st.verify()
        assert not report.ok and any("capsule repair" in p for p in report.problems), report
    with check_exact(tmp_path / "s") as st:
        assert st.load_epoch(N - 1)[1] == view(N - 1) and st.verify().ok


# -- finding 6: signed stores repointed or transplanted -------------------------------------------
def test_signed_store_cannot_be_repointed_at_older_records(tmp_path):
    build(tmp_path / "s", key=KEY_A)
    sql(tmp_path / "s", f"UPDATE pages SET (rec_epoch, segment, offset, length) = (SELECT rec_epoch, segment, "
                        f"offset, length FROM pages AS o WHERE o.region = 'rng' AND o.epoch = 2) "
                        f"WHERE region = 'rng' AND epoch = {N}")
    check_exact(tmp_path / "s", KEY_A).close()


def test_signed_store_refuses_records_transplanted_from_another_store(tmp_path):
    build(tmp_path / "a", key=KEY_A)
    with Store.open(tmp_path / "b", sign_key=KEY_A) as st:        # same key, other contents
        for e in range(1, N + 1):
            st.write_epoch([(r, i, b"B" * len(d)) for r, i, d in pages_for(e)], b'{"epoch": %d}' % e)
    seg_a, seg_b = tmp_path / "a" / "segments" / "000001.seg", tmp_path / "b" / "segments" / "000001.seg"
    con_b = sqlite3.connect(tmp_path / "b" / "index.sqlite")
    rows = con_b.execute(f"SELECT region, idx, offset, length FROM pages WHERE epoch = {N}").fetchall()
    con_b.close()
    data_b, base = seg_b.read_bytes(), seg_a.stat().st_size
    con = sqlite3.connect(tmp_path / "a" / "index.sqlite")
    with open(seg_a, "ab") as f:                      # append B's records; point A's rows at them
        for region, idx, off, length in rows:
            con.execute(f"UPDATE pages SET offset = ?, length = ? WHERE region = ? AND idx = ? AND epoch = {N}",
                        (base + f.tell(), length, region, idx))
            f.write(data_b[off:off + length])
        end = base + f.tell()
    con.execute("UPDATE segments SET committed_end = ?", (end,))
    con.commit()
    con.close()
    with check_exact(tmp_path / "a", KEY_A) as st:
        assert st.load_epoch(N)[1] == view(N)


# -- finding 7: hostile values in the index ---------------------------------------------------------
@pytest.mark.parametrize("edit", [
    "UPDATE pages SET offset = 'abc' WHERE epoch = 4",
    "UPDATE epochs SET man_length = 1.5 WHERE id = 7",
    "UPDATE segments SET committed_end = x'00ff'",
    "UPDATE epochs SET base = 'zero' WHERE id = 12",
    "UPDATE pages SET region = x'ff00' WHERE epoch = 2",
])
def test_wrongly_typed_index_values_are_rebuilt_not_raised(tmp_path, edit):
    build(tmp_path / "s")
    sql(tmp_path / "s", edit)
    with check_exact(tmp_path / "s") as st:
        report = st.verify()          # only looks: a value no read needed yet is reported
        if not report.ok:
            assert any(p.startswith("index:") and "capsule repair" in p for p in report.problems), report
            assert "rebuilt" in st.repair()[0]
        assert [i.id for i in st.epochs()] == list(range(1, N + 1)) and st.verify().ok
        assert st.load_epoch(7)[1] == view(7)


# -- finding 11 (index part): many bogus epoch rows ------------------------------------------------
def test_bogus_epoch_rows_are_dropped_by_a_rebuild(tmp_path):
    build(tmp_path / "s")
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    con.executemany("INSERT INTO epochs VALUES (?, NULL, 0, 0, 0, '{}', 0, 1, ?, 500)",
                    [(N + 1 + i, 24 + 7 * i) for i in range(20_000)])
    con.commit()
    con.close()
    with check_exact(tmp_path / "s") as st:
        assert st.latest_epoch() == N


def test_every_index_failure_is_typed(tmp_path):
    build(tmp_path / "s")
    (tmp_path / "s" / "index.sqlite").write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    try:
        check_exact(tmp_path / "s").close()
    except CapsuleError:
        pytest.fail("the index can be rebuilt from an intact log")


@pytest.mark.parametrize("stage", ["building", "swapping"])
def test_a_rebuild_interrupted_at_any_point_is_redone(tmp_path, stage):
    build(tmp_path / "s")
    s = tmp_path / "s"
    (s / "index.sqlite.rebuild").write_bytes(b"SQLite format 3\x00half written")   # the crashed rebuild
    if stage == "swapping":          # the old index was moved aside, the new one not yet renamed
        (s / "quarantine" / "x-index").mkdir(parents=True)
        for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
            if (s / name).exists():
                (s / name).rename(s / "quarantine" / "x-index" / name)
    with check_exact(s) as st:
        assert not (s / "index.sqlite.rebuild").exists()
        assert bool(st.recovery_report) == (stage == "swapping")


def test_a_rebuild_does_not_bring_back_epochs_retention_dropped(tmp_path):
    build(tmp_path / "s")
    with Store.open(tmp_path / "s") as st:
        st.write_epoch(pages_for(N + 1), b'{"epoch": %d}' % (N + 1), name="keep-me")
        assert st.retain(3) == N - 2                     # 1..N-2 dropped (their records still on disk)
        st.write_epoch(pages_for(N + 2), b'{"epoch": %d}' % (N + 2))   # its envelope names what is kept
    (tmp_path / "s" / "index.sqlite").write_bytes(b"garbage")
    with check_exact(tmp_path / "s", newest=N + 2) as st:
        assert [e.id for e in st.epochs()] == [N - 1, N, N + 1, N + 2] and st.resolve("keep-me") == N + 1
