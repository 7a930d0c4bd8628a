"""capsule.store facts: persistent memory facts (index row + KV record) next to epochs."""
from __future__ import annotations

import errno
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from capsule.memory import factsearch
from capsule.memory.facterrors import FactCorrupt, UnknownFact
from capsule.memory.factrows import FactInfo
from capsule.memory.facttable import FactTable
from capsule.store import PageCorrupt, SigningKeyError, Store, StoreIOError, keyeddb
from test_store import Faulty, flip   # FileOps that fails chosen operations; flip a byte
from test_store_records import records_of as fact_records, sql   # every keyed record; SQL on the index
from capsule.store.records import KIND_RECORD as KIND_FACT, RECORD_HEADER, Sealer, encode_record

FACT_REGION = "fact"

SDK = str(Path(__file__).resolve().parents[1] / "sdk")
KEY = b"k" * 32
FACTS = [("The charger is in bay 2 next to the workbench.", ("location", "charger")),
         ("The red cup is fragile; carry it with both grippers.", ("object",)),
         ("Alice prefers green tea in the morning.", ("person", "preference")),
         ("The elevator to floor 3 is out of service until Friday.", ("building",)),
         ("Battery swaps happen every six hours on weekdays.", ("schedule", "battery"))]


def kv(i: int, n: int = 3000, version: int = 1) -> bytes:
    return (f"kv{i}/{version};".encode() * n)[:n]


def add_all(st: Store, n: int = 3000) -> list[int]:
    return [FactTable(st).add_fact(text, tags=tags, n_tokens=len(text.split()), fingerprint="qwen2-0.5b", rope="rope-1e6",
                        kv=kv(i, n)) for i, (text, tags) in enumerate(FACTS)]


def test_round_trip_across_reopen(tmp_path):
    t0 = time.time()
    with Store.open(tmp_path / "s") as st:
        st.write_epoch([("kv", 0, b"page")], b"{}")
        ids = add_all(st)
        FactTable(st).set_fact_embedding(ids[1], b"\x01" * 16, "minilm")
        assert ids == [1, 2, 3, 4, 5] and FactTable(st).count_facts() == 5 and st.stats()["records"] == 5
        assert st.stats()["live_bytes"] == st.verify().bytes  # every record is live, fact KVs included
    with Store.open(tmp_path / "s", create=False) as st:
        infos = FactTable(st).facts()
        assert [f.id for f in infos] == ids
        assert infos[0] == FactInfo(1, FACTS[0][0], ("location", "charger"), 10, "qwen2-0.5b", "rope-1e6",
                                    infos[0].created)
        assert t0 <= infos[0].created <= time.time()
        assert all(FactTable(st).fact_kv(i) == kv(i - 1) for i in ids)
        assert FactTable(st).facts([4, 2, 99, 2]) == [infos[1], infos[3]]  # ordered by id, unknown left out
        assert FactTable(st).facts(iter(range(-5, 2000))) == infos and FactTable(st).facts([]) == []  # chunked id lists
        assert FactTable(st).facts([np.int64(2)]) == [infos[1]] and FactTable(st).fact_kv(np.int32(2)) == kv(1)  # vector-index ids
        assert FactTable(st).fact_embeddings() == [(2, "minilm", b"\x01" * 16)]
        FactTable(st).set_fact_embedding(2, None, None)
        assert FactTable(st).fact_embeddings() == [] and st.load_epoch(1)[1] == {"kv": {0: b"page"}}
        assert st.verify().ok


def test_forget_and_ids_are_never_reused(tmp_path):
    with Store.open(tmp_path / "s") as st:
        ids = add_all(st, 100)
        FactTable(st).forget_fact(5)
        FactTable(st).forget_fact(2)
        for call in (lambda: FactTable(st).fact_kv(5), lambda: FactTable(st).forget_fact(5),
                     lambda: FactTable(st).set_fact_embedding(2, None, None),
                     lambda: FactTable(st).set_fact_kv(2, n_tokens=1, fingerprint="f", rope="r", kv=b"x"),
                     lambda: FactTable(st).fact_kv(0), lambda: FactTable(st).fact_kv(2 ** 70)):
            with pytest.raises(UnknownFact) as err:
                call()
            assert isinstance(err.value, KeyError) and "no fact" in str(err.value)
        with pytest.raises(UnknownFact, match="no fact 5 "):
            FactTable(st).fact_kv(5)
        assert [f.id for f in FactTable(st).facts()] == [1, 3, 4] and FactTable(st).count_facts() == 3
        assert FactTable(st).search_facts("battery", 5) == [] and FactTable(st).search_facts("charger", 5)[0][0] == 1
        assert FactTable(st).add_fact("new", n_tokens=1, fingerprint="f", rope="r", kv=b"n") == 6  # not 5
    with Store.open(tmp_path / "s") as st:
        FactTable(st).forget_fact(6)
        assert FactTable(st).add_fact("newer", n_tokens=1, fingerprint="f", rope="r", kv=b"n") == 7
        assert FactTable(st).fact_kv(7) == b"n" and st.verify().ok
        with pytest.raises(ValueError, match="id is an int"):
            FactTable(st).fact_kv("7")


NASTY = ['"', '""', "'", "AND", "OR", "NOT", "NEAR", "NEAR(", "NEAR(a b, 2)", "*", "a*", "a:b", "text:charger",
         "(((", ")))", "^start", "-x", "+", "{text tags}: a", "🤖", "🔋 battery 🔋", "_", "__init__", "\x00",
         "é", "ǅ", "\u0301", "日本語", "a" * 5000, " ".join(["charger"] * 500), "charger OR",
         "AND charger AND",
         "\ud800", "tea\u200bcup"]


def test_search_ranks_keywords_and_never_raises(tmp_path):
    with Store.open(tmp_path / "s") as st:
        add_all(st, 50)
        for i in range(20):  # background facts, so BM25's idf is meaningful
            FactTable(st).add_fact(f"filler note number {i} about nothing much", tags=("misc",), n_tokens=6,
                        fingerprint="f", rope="r", kv=b"z")
        for query, want in [("charger", 1), ("where is the CHARGER?", 1), ("fragile cup", 2), ("tea", 3),
                            ("Alice", 3), ("elevator floor", 4), ("batteries", 5), ("schedule", 5),
                            ("preference", 3), ('"red cup" AND (grippers)', 2), ("NEAR(elevator)", 4)]:
            hits = FactTable(st).search_facts(query, 3)
            assert hits and hits[0][0] == want, (query, hits)
            assert all(s > 0 for _, s in hits) and hits == sorted(hits, key=lambda h: -h[1])
        assert len(FactTable(st).search_facts("filler", 5)) == 5 and FactTable(st).search_facts("filler", 0) == []
        for query in NASTY:
            assert isinstance(FactTable(st).search_facts(query, 5), list), query
        assert FactTable(st).search_facts("", 5) == [] and FactTable(st).search_facts("   ", 5) == []
        with pytest.raises(ValueError):
            FactTable(st).search_facts(b"charger", 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            FactTable(st).search_facts("charger", -1)

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(hs.text(max_size=40))
        def any_text(q):
            FactTable(st).search_facts(q, 3)
        any_text()


def test_search_without_fts5_falls_back_to_term_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(factsearch, "fts5_available", lambda: False)
    with Store.open(tmp_path / "s") as st:
        add_all(st, 50)
        assert FactTable(st).search_facts("charger", 3)[0][0] == 1 and FactTable(st).search_facts("the red CUP", 3)[0][0] == 2
        for query in NASTY:
            FactTable(st).search_facts(query, 5)
        FactTable(st).forget_fact(1)
        assert FactTable(st).search_facts("charger", 3) == [] and st.verify().ok
    monkeypatch.undo()  # FTS5 again: the table is created at open and filled from the existing rows
    with Store.open(tmp_path / "s") as st:
        assert FactTable(st).search_facts("fragile", 3)[0][0] == 2 and st.verify().ok


def test_set_fact_kv_replaces_and_compaction_reclaims(tmp_path):
    with Store.open(tmp_path / "s", segment_bytes=16384) as st:
        ids = add_all(st)  # five 3 KB records: all in segment 1
        FactTable(st).set_fact_kv(3, n_tokens=11, fingerprint="llama-3.2-1b", rope="rope-5e5", kv=kv(3, 2500, version=2))
        info = FactTable(st).facts([3])[0]
        assert (info.n_tokens, info.fingerprint, info.rope) == (11, "llama-3.2-1b", "rope-5e5")
        assert FactTable(st).fact_kv(3) == kv(3, 2500, version=2) and info.text == FACTS[2][0]
        heads = [(seg.name, h.epoch) for seg, _, h in fact_records(tmp_path / "s") if h.index == 3]
        assert heads == [("000001.seg", 1), ("000002.seg", 2)]  # the KV version binds the record
        for e in range(1, 6):  # epochs after the facts, in the active segment 2
            st.write_epoch([("kv", e, b"p" * 1000)], b"{}")
        for fid in (1, 2, 4):
            FactTable(st).forget_fact(fid)
        before = st.stats()
        assert st.retain(1) == 4 and FactTable(st).count_facts() == 2  # retention never drops facts
        reclaimed = st.compact()  # segment 1 holds only fact 5 alive (old KV of 3 is dead)
        after = st.stats()
        assert reclaimed > 10000 and after["segment_bytes"] < before["segment_bytes"] - 10000
        assert not (tmp_path / "s" / "segments" / "000001.seg").exists()
        assert FactTable(st).fact_kv(3) == kv(3, 2500, version=2) and FactTable(st).fact_kv(5) == kv(4)
        assert st.load_epoch(5)[1]["kv"][5] == b"p" * 1000 and st.verify().ok
    with Store.open(tmp_path / "s", segment_bytes=16384) as st:
        assert FactTable(st).fact_kv(3) == kv(3, 2500, version=2) and FactTable(st).fact_kv(5) == kv(4)
        assert [f.id for f in FactTable(st).facts()] == [3, 5] and st.verify().ok
        assert ids[-1] == 5 and FactTable(st).add_fact("after", n_tokens=1, fingerprint="f", rope="r", kv=b"a") == 6


def test_flipped_bit_in_a_fact_record(tmp_path):
    with Store.open(tmp_path / "s") as st:
        st.write_epoch([("kv", 0, b"page" * 100)], b"{}")
        add_all(st, 1000)
    seg, off, head = [r for r in fact_records(tmp_path / "s") if r[2].index == 2][0]
    flip(seg, off + RECORD_HEADER.size + head.name_len + 500, 0x01)
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(PageCorrupt) as err:
            FactTable(st).fact_kv(2)
        e = err.value
        assert isinstance(e, FactCorrupt) and (e.region, e.index, e.fact_id, e.segment, e.offset) == \
            ("fact", 2, 2, 1, off) and "checksum mismatch" in str(e) and "fact 2" in str(e)
        assert FactTable(st).fact_kv(1) == kv(0, 1000) and FactTable(st).fact_kv(3) == kv(2, 1000)
        assert st.load_epoch(1)[1] == {"kv": {0: b"page" * 100}}
        report = st.verify()
        assert not report.ok and report.records_bad == (("fact", 2),) and report.epochs_ok == (1,)
        assert any(p.startswith("fact 2:") for p in report.problems), report.problems
        FactTable(st).set_fact_kv(2, n_tokens=1, fingerprint="f", rope="r", kv=b"re-encoded")  # the way out
        assert FactTable(st).fact_kv(2) == b"re-encoded" and st.verify().records_bad == ()


def test_records_of_other_facts_or_pages_cannot_stand_in(tmp_path):
    with Store.open(tmp_path / "s") as st:
        st.write_epoch([(FACT_REGION, 1, b"a page posing as fact 1")], b"{}")
        add_all(st, 200)
        FactTable(st).set_fact_kv(4, n_tokens=1, fingerprint="f", rope="r", kv=b"v2")
    recs = {(h.index, h.epoch): (off, h.total) for _, off, h in fact_records(tmp_path / "s")}
    page_off, page_len = sql_row(tmp_path, "SELECT offset, length FROM pages")
    for fid, (off, length), why in [(1, recs[(2, 1)], "index expects"), (1, (page_off, page_len), "kind 1"),
                                    (4, recs[(4, 1)], "epoch 1")]:  # another fact, a page, an older KV
        sql(tmp_path / "s", f"UPDATE records SET offset = {off}, length = {length} WHERE collection = 'fact' AND id = {fid}")
        with Store.open(tmp_path / "s") as st:
            with pytest.raises(FactCorrupt, match=why):
                FactTable(st).fact_kv(fid)
            assert ("fact", fid) in st.verify().records_bad


def sql_row(path: Path, query: str) -> tuple:
    con = sqlite3.connect(path / "s" / "index.sqlite")
    try:
        return con.execute(query).fetchone()
    finally:
        con.close()


@pytest.mark.parametrize("op", ["write", "fsync", "index"])
def test_failed_fact_write_leaves_nothing_and_the_store_works(tmp_path, op, monkeypatch):
    fs = Faulty()
    with Store.open(tmp_path / "s", fs=fs) as st:
        add_all(st, 500)
        seg = sorted((tmp_path / "s" / "segments").glob("*.seg"))[-1]
        size = seg.stat().st_size
        if op == "index":  # the row goes in, then the transaction fails: nothing of it may stay
            real = keyeddb.put

            def broken(c, *a):
                real(c, *a)
                raise sqlite3.OperationalError("disk I/O error (injected)")
            monkeypatch.setattr(keyeddb, "put", broken)
        else:
            fs.fail[op] = errno.ENOSPC if op == "write" else errno.EIO
        with pytest.raises(StoreIOError, match={"write": "ENOSPC", "fsync": "EIO", "index": "injected"}[op]):
            FactTable(st).add_fact("the spare charger is in bay 9", n_tokens=6, fingerprint="f", rope="r", kv=b"k" * 4000)
        assert FactTable(st).count_facts() == 5 and FactTable(st).search_facts("spare", 3) == [] and seg.stat().st_size == size
        fs.fail.clear()
        monkeypatch.undo()
        assert FactTable(st).add_fact("after the failure", n_tokens=3, fingerprint="f", rope="r", kv=b"ok") == 6
        assert FactTable(st).fact_kv(6) == b"ok" and st.verify().ok
    with Store.open(tmp_path / "s") as st:
        assert FactTable(st).count_facts() == 6 and FactTable(st).fact_kv(6) == b"ok" and st.verify().ok


def test_staged_epochs_commit_before_a_fact(tmp_path):
    with Store.open(tmp_path / "s") as st:
        assert st.stage_epoch([("kv", 0, b"staged")], b"{}") == 1
        FactTable(st).add_fact("fact after a staged epoch", n_tokens=5, fingerprint="f", rope="r", kv=b"k")
        assert st.latest_epoch() == 1 and st.sync() == []
    with Store.open(tmp_path / "s") as st:
        assert st.load_epoch(1)[1] == {"kv": {0: b"staged"}} and FactTable(st).fact_kv(1) == b"k" and st.verify().ok


def test_torn_fact_record_past_commit_is_cut(tmp_path):
    with Store.open(tmp_path / "s") as st:
        add_all(st, 300)
    seg = sorted((tmp_path / "s" / "segments").glob("*.seg"))[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:  # a fact write that died mid-record, before its commit
        f.write(encode_record(Sealer(None), KIND_FACT, 1, FACT_REGION, 6, b"x" * 900)[0] + b"x" * 100)
    with Store.open(tmp_path / "s") as st:
        assert seg.stat().st_size == size and FactTable(st).count_facts() == 5
        assert FactTable(st).add_fact("next", n_tokens=1, fingerprint="f", rope="r", kv=b"n") == 6 and st.verify().ok


CHILD = '''
import os, sys, types
pkg = types.ModuleType("capsule"); pkg.__path__ = [os.path.join(sys.argv[1], "capsule")]
sys.modules["capsule"] = pkg
from capsule.store import Store
st = Store.open(sys.argv[2], segment_bytes=16384)
print("ready", flush=True)
i = FactTable(st).count_facts()
while True:
    i += 1
    fid = FactTable(st).add_fact(f"fact number {i}", n_tokens=3, fingerprint="f", rope="r", kv=str(i).encode() * 700)
    print(fid, flush=True)
    if i % 5 == 0:
        FactTable(st).forget_fact(fid - 3)
        st.compact()
'''


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15])
def test_sigkill_never_loses_an_acknowledged_fact(tmp_path, delay):
    path = tmp_path / "s"
    child = subprocess.Popen([sys.executable, "-c", CHILD, SDK, str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"ready", child.stderr.read().decode()
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait()
    acked = [int(x) for x in child.stdout.read().split()]
    with Store.open(path) as st:
        have = {f.id: f.text for f in FactTable(st).facts()}
        for fid in acked:
            if fid in have:  # some acknowledged facts were forgotten on purpose
                assert have[fid] == f"fact number {fid}" and FactTable(st).fact_kv(fid) == str(fid).encode() * 700
        forgotten = {fid - 3 for fid in acked if fid % 5 == 0}  # forget_fact may or may not have run
        assert all(fid in have for fid in acked if fid not in forgotten)
        assert not set(have) - set(acked) - {max(acked, default=0) + 1}  # at most the unacknowledged last one
        assert st.verify().ok, st.verify().problems
        assert FactTable(st).add_fact("usable", n_tokens=1, fingerprint="f", rope="r", kv=b"u") > max(acked, default=0)


def test_readers_alongside_a_fact_writer(tmp_path):
    with Store.open(tmp_path / "s", segment_bytes=8192) as st:
        add_all(st, 1500)
        done, errors = threading.Event(), []

        def read() -> None:
            try:
                while not done.is_set():
                    assert FactTable(st).fact_kv(1) == kv(0, 1500) and FactTable(st).search_facts("charger", 1)[0][0] == 1
                    infos = FactTable(st).facts()
                    assert all(f.text.startswith("note") for f in infos if f.id > 5)
            except Exception as exc:  # surfaced in the main thread
                errors.append(exc)
        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for i in range(60):
                fid = FactTable(st).add_fact(f"note {i}", n_tokens=2, fingerprint="f", rope="r", kv=b"n" * 1500)
                if i % 3:
                    FactTable(st).forget_fact(fid)
                if i % 10 == 9:
                    st.compact()
        finally:
            done.set()
            for t in readers:
                t.join()
        assert not errors, errors
        assert FactTable(st).count_facts() == 25 and st.verify().ok


def test_signed_store_facts(tmp_path):
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        add_all(st, 400)
        FactTable(st).set_fact_embedding(1, b"e" * 8, "minilm")
    with pytest.raises(SigningKeyError):
        Store.open(tmp_path / "s")
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        assert FactTable(st).fact_kv(3) == kv(2, 400) and st.verify().ok and FactTable(st).search_facts("tea", 1)[0][0] == 3
    # someone without the key rewrites fact 3's KV with a valid xxh3 tag
    seg, off, head = [r for r in fact_records(tmp_path / "s") if r[2].index == 3][0]
    forged = b"".join(encode_record(Sealer(None), KIND_FACT, 1, FACT_REGION, 3, b"E" * head.payload_len))
    with open(seg, "r+b") as f:
        f.seek(off)
        f.write(forged)
    sql(tmp_path / "s", f"UPDATE records SET length = {len(forged)} WHERE collection = 'fact' AND id = 3")
    with Store.open(tmp_path / "s", sign_key=KEY) as st:
        with pytest.raises(FactCorrupt, match="not signed"):
            FactTable(st).fact_kv(3)
        assert FactTable(st).fact_kv(2) == kv(1, 400) and st.verify().records_bad == (("fact", 3),)


def test_store_without_fact_tables_opens_and_gains_them(tmp_path):
    with Store.open(tmp_path / "s") as st:
        st.write_epoch([("kv", 0, b"old")], b'{"old": 1}')
    sql(tmp_path / "s", "DROP TABLE records", "DROP TABLE forgotten", "DROP TABLE record_ids",  # as before facts
        "UPDATE meta SET value = '1' WHERE key = 'format_version'")
    with Store.open(tmp_path / "s", create=False) as st:
        assert FactTable(st).count_facts() == 0 and FactTable(st).facts() == [] and FactTable(st).search_facts("anything", 3) == []
        assert FactTable(st).add_fact("learned later", tags=("new",), n_tokens=2, fingerprint="f", rope="r", kv=b"k") == 1
        assert st.load_epoch(1) == (b'{"old": 1}', {"kv": {0: b"old"}}) and st.verify().ok
    # opening marks the store format 4 (self-describing log, generic records), which older SDKs refuse,
    # and remembers that epochs up to 1 were written before envelopes
    assert sql_row(tmp_path, "SELECT value FROM meta WHERE key = 'format_version'") == ("4",)
    assert sql_row(tmp_path, "SELECT value FROM meta WHERE key = 'legacy_until'") == ("1",)
    with Store.open(tmp_path / "s") as st:
        assert FactTable(st).fact_kv(1) == b"k" and FactTable(st).search_facts("learned", 1)[0][0] == 1


def test_bounds_are_value_errors(tmp_path):
    good = dict(n_tokens=1, fingerprint="f", rope="r", kv=b"k")
    with Store.open(tmp_path / "s") as st:
        for text, extra, msg in [
                ("", {}, "non-empty"), (None, {}, "non-empty"), ("é" * 40000, {}, "65536"),
                ("ok", {"tags": "abc"}, "sequence of str"), ("ok", {"tags": ["t"] * 65}, "at most 64"),
                ("ok", {"tags": ["x" * 257]}, "256"), ("ok", {"tags": [""]}, "non-empty"),
                ("ok", {"tags": [3]}, "non-empty str"), ("ok", {"fingerprint": ""}, "fingerprint"),
                ("ok", {"rope": "r" * 1025}, "1024"), ("ok", {"n_tokens": -1}, "n_tokens"),
                ("ok", {"n_tokens": True}, "n_tokens"), ("ok", {"kv": "text"}, "kv must be bytes"),
                ("ok", {"embedding": b"e"}, "together"), ("ok", {"embedding": b"", "embedder": "m"}, "1 to"),
                ("ok", {"embedding": b"e", "embedder": ""}, "embedder"), ("\ud800", {}, "surrogates")]:
            with pytest.raises(ValueError, match=msg):
                FactTable(st).add_fact(text, **{**good, **extra})
        assert FactTable(st).count_facts() == 0
        assert FactTable(st).add_fact("x" * (64 << 10), tags=["t" * 256] * 64, **good) == 1
        with pytest.raises(ValueError, match="fingerprint"):
            FactTable(st).set_fact_kv(1, n_tokens=1, fingerprint="", rope="r", kv=b"k")
        assert FactTable(st).fact_kv(1) == b"k"
    for path in (tmp_path / "s", tmp_path / "s" / "index.sqlite", *(tmp_path / "s" / "segments").iterdir()):
        assert path.stat().st_mode & 0o077 == 0, path


def test_region_json_takes_either_packing_and_refuses_a_run_in_the_middle():
    from capsule.llm.region import Region
    end_packed = {"gap_at": 10, "start": 16, "size": 32, "facts": [[1, 40, 5], [2, 45, 3]]}
    r = Region.from_json(end_packed, 16, 1024)
    assert r.used == (40, 48) and r.end == 48
    legacy = {"gap_at": 10, "start": 16, "size": 32, "facts": [[1, 16, 5], [2, 21, 3]]}
    assert Region.from_json(legacy, 16, 1024).used == (16, 24)     # capsules made before
    for facts in ([[1, 20, 5]], [[1, 40, 5], [2, 46, 2]], [[1, 44, 5]], [[1, 16, 0]]):
        with pytest.raises(ValueError, match="region"):
            Region.from_json(dict(end_packed, facts=facts), 16, 1024)
    assert Region.from_json(dict(end_packed, facts=[]), 16, 1024).used == (48, 48)
