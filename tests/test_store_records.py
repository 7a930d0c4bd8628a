"""capsule.store keyed records: a caller's typed row plus an opaque blob, durable, checked on read,
rebuilt from the log (forgets included), signed; and older indexes upgraded in place."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from capsule.store import (Collection, IndexCorrupt, PageCorrupt, RecordCorrupt, RecordRowCorrupt, Store,
                           UnknownRecord)
from capsule.store.records import KIND_RECORD, RECORD_HEADER, parse_header

NOTES = Collection("note", (("title", "text"), ("labels", "texts"), ("size", "int"), ("at", "real")))
OTHER = Collection("other", (("title", "text"),))
KEY = b"k" * 32


def row(title: str, size: int = 1) -> dict:
    return {"title": title, "labels": ["a", "b"], "size": size, "at": 1.5}


def sql(path: Path, *statements: str) -> None:
    con = sqlite3.connect(path / "index.sqlite")
    for s in statements:
        con.execute(s)
    con.commit()
    con.close()


def records_of(path: Path) -> list[tuple[Path, int, object]]:
    out = []
    for seg in sorted((path / "segments").glob("*.seg")):
        data, off = seg.read_bytes(), 24
        while off < len(data):
            head = parse_header(data[off:off + RECORD_HEADER.size])
            if head.kind == KIND_RECORD:
                out.append((seg, off, head))
            off += head.total
    return out


def test_put_get_list_forget_and_ids_per_collection(tmp_path):
    with Store.open(tmp_path / "s") as st:
        a, b = st.put_record(NOTES, row("one"), b"blob-1"), st.put_record(NOTES, row("two", 2), b"blob-2")
        assert (a, b, st.put_record(OTHER, {"title": "x"}, b"")) == (1, 2, 1)     # ids per collection
        got = st.record(NOTES, b)
        assert (got.row, got.blob, got.version, got.headless) == (row("two", 2), b"blob-2", 1, False)
        assert [(r.id, r.row["title"], r.damage) for r in st.records(NOTES)] == [(1, "one", None), (2, "two", None)]
        st.forget_record(NOTES, a)
        with pytest.raises(UnknownRecord, match="no note 1 .*never reused"):
            st.record(NOTES, a)
        assert st.put_record(NOTES, row("three"), b"3") == 3 and st.count_records(NOTES) == 2
        st.replace_record(NOTES, b, row("two", 22), b"blob-2b", same=("title",))
        assert st.record(NOTES, b)[1:4] == (2, row("two", 22), b"blob-2b")
        st.set_record_cache(NOTES, b, b"cache")
        assert st.record_caches(NOTES) == [(2, b"cache")] and st.verify().ok


@pytest.mark.parametrize("bad, why", [({"title": 5, "labels": [], "size": 1, "at": 1.0}, "note.title must be of type text"),
                                      ({"title": "t", "labels": "ab", "size": 1, "at": 1.0}, "note.labels"),
                                      ({"title": "t", "labels": [], "size": True, "at": 1.0}, "note.size"),
                                      ({"title": "t", "labels": [], "size": 1, "at": float("nan")}, "note.at"),
                                      ({"title": "t", "labels": [], "size": 1}, "missing \\['at'\\]"),
                                      ({**row("t"), "x": 1}, "extra")])
def test_rows_are_typed_on_write(tmp_path, bad, why):
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(ValueError, match=why):
            st.put_record(NOTES, bad, b"")
        assert st.count_records(NOTES) == 0 and st.verify().records == 0


def test_a_row_read_back_with_a_wrong_type_is_flagged_never_handed_out(tmp_path):
    with Store.open(tmp_path / "s") as st:
        st.put_record(NOTES, row("one"), b"1")
        st.put_record(NOTES, row("two"), b"2")
    sql(tmp_path / "s", "UPDATE records SET row = json_set(row, '$.size', 'big') WHERE id = 2",
        "UPDATE records SET row = CAST(x'ff' AS TEXT) WHERE id = 1")
    with Store.open(tmp_path / "s") as st:
        got = st.records(NOTES)
        assert [(r.id, r.row) for r in got] == [(1, None), (2, None)]
        assert "note.size must be of type int" in got[1].damage and got[1].raw["title"] == "two"
        with pytest.raises(RecordRowCorrupt, match="note 2: its index row is damaged: row: note.size"):
            st.record(NOTES, 2)
        report = st.verify()                      # only what is not a JSON object at all is the store's to see
        assert not report.ok and report.records_bad == (("note", 1),)
        st.repair()                               # rows come back from their records
        assert [r.row for r in st.records(NOTES)] == [row("one"), row("two")] and st.verify().ok


def test_a_damaged_record_and_an_edited_row(tmp_path):
    with Store.open(tmp_path / "s") as st:
        st.put_record(NOTES, row("one"), b"x" * 500)
        st.put_record(NOTES, row("two"), b"y" * 500)
    seg, off, head = records_of(tmp_path / "s")[0]
    data = bytearray(seg.read_bytes())
    data[off + head.total - 100] ^= 1
    seg.write_bytes(bytes(data))
    sql(tmp_path / "s", "UPDATE records SET row = json_set(row, '$.title', 'TWO') WHERE id = 2")
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(RecordCorrupt, match="note 1: its record .*checksum mismatch") as err:
            st.record(NOTES, 1)
        assert isinstance(err.value, PageCorrupt) and (err.value.region, err.value.index) == ("note", 1)
        with pytest.raises(RecordRowCorrupt, match="differs from the row its record was written with"):
            st.record(NOTES, 2)
        with pytest.raises(RecordRowCorrupt, match="title: differs"):      # a replace may not launder it
            st.replace_record(NOTES, 2, row("TWO"), b"z", same=("title",))
        st.replace_record(NOTES, 1, row("one"), b"fixed", same=("title",))  # a damaged record: the repair
        assert st.record(NOTES, 1).blob == b"fixed" and ("note", 1) not in st.verify().records_bad


@pytest.mark.parametrize("key", [None, KEY])
def test_a_rebuilt_index_keeps_rows_and_forgets_and_never_reuses_ids(tmp_path, key):
    with Store.open(tmp_path / "s", sign_key=key) as st:
        st.write_epoch([("r", 0, b"page")], b"{}")
        for i in range(4):
            st.put_record(NOTES, row(f"n{i}"), b"b%d" % i)
        st.replace_record(NOTES, 2, row("n1", 9), b"v2")
        st.forget_record(NOTES, 3)
        st.forget_record(NOTES, 4)
        st.set_record_cache(NOTES, 1, b"c")
        st.repair()
        assert [(r.id, r.version, r.row["size"]) for r in st.records(NOTES)] == [(1, 1, 1), (2, 2, 9)]
        assert st.record(NOTES, 2).blob == b"v2" and st.record_caches(NOTES) == []   # caches: the caller's
        with pytest.raises(UnknownRecord):
            st.record(NOTES, 3)                   # a forgotten record stays forgotten
        assert st.put_record(NOTES, row("n5"), b"") == 5 and st.verify().ok
    (tmp_path / "s" / "index.sqlite").write_bytes(b"garbage" * 100)   # damage: rebuilt at open
    for suffix in ("-wal", "-shm"):
        (tmp_path / "s" / f"index.sqlite{suffix}").unlink(missing_ok=True)
    if key:
        with pytest.raises(IndexCorrupt, match="no record .* verifies"):   # not without the key
            Store.open(tmp_path / "s")
    with Store.open(tmp_path / "s", sign_key=key) as st:
        assert [r.id for r in st.records(NOTES)] == [1, 2, 5] and st.put_record(NOTES, row("n6"), b"") == 6


def test_an_index_of_format_3_is_upgraded_in_place(tmp_path):
    facts = Collection("fact", (("text", "text"), ("tags", "texts"), ("n", "int")))
    with Store.open(tmp_path / "s") as st:
        st.write_epoch([("r", 0, b"page")], b"{}")
        for t in ("alpha", "beta", "gamma"):
            st.put_record(facts, {"text": t, "tags": ["x"], "n": 1}, t.encode())
        st.forget_record(facts, 3)
    # the format-3 layout: its own tables for the one collection, rows as columns
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    recs = con.execute("SELECT id, version, segment, offset, length FROM records ORDER BY id").fetchall()
    forgot = con.execute("SELECT id, segment, offset, length FROM forgotten").fetchall()
    con.executescript('DROP TABLE records; DROP TABLE forgotten; DROP TABLE record_ids; '
                      'CREATE TABLE facts (id INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT NOT NULL, tags TEXT '
                      'NOT NULL, n INTEGER NOT NULL, kv_version INTEGER NOT NULL, kv_segment INTEGER NOT NULL, '
                      'kv_offset INTEGER NOT NULL, kv_length INTEGER NOT NULL, embedder TEXT, embedding BLOB); '
                      'CREATE TABLE forgets (id INTEGER PRIMARY KEY, segment INTEGER NOT NULL, offset INTEGER '
                      'NOT NULL, length INTEGER NOT NULL);'
                      "UPDATE meta SET value = '3' WHERE key = 'format_version';")
    for (rid, version, seg, off, length), text in zip(recs, ("alpha", "beta")):
        con.execute("INSERT INTO facts VALUES (?, ?, '[\"x\"]', 1, ?, ?, ?, ?, 'e', x'00')",
                    (rid, text, version, seg, off, length))
    con.executemany("INSERT INTO forgets VALUES (?, ?, ?, ?)", forgot)
    con.execute("UPDATE sqlite_sequence SET seq = 3 WHERE name = 'facts'")
    con.commit()
    con.close()
    with Store.open(tmp_path / "s") as st:
        assert [(r.id, r.row) for r in st.records(facts)] == [(1, {"text": "alpha", "tags": ["x"], "n": 1}),
                                                             (2, {"text": "beta", "tags": ["x"], "n": 1})]
        assert st.record(facts, 2).blob == b"beta" and st.put_record(facts, {"text": "d", "tags": [], "n": 0}, b"") == 4
        assert st.load_epoch(1)[1] == {"r": {0: b"page"}} and st.verify().ok
        st.compact(threshold=1.0)
        st.repair()
        assert [r.id for r in st.records(facts)] == [1, 2, 4]      # the forget survived the upgrade
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    assert con.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone() == ("4",)
    con.close()


def test_collections_are_checked(tmp_path):
    for bad in [("1x", (("a", "text"),)), ("ok", ()), ("ok", (("store", "text"),)), ("ok", (("a", "blob"),)),
                ("ok", (("a", "text"), ("a", "int")))]:
        with pytest.raises(ValueError):
            Collection(*bad)
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(ValueError, match="Collection"):
            st.put_record("note", row("x"), b"")      # type: ignore[arg-type]
