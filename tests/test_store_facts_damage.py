"""capsule.store facts read back from a damaged index.sqlite: a damaged row is one damaged fact
(skipped with a warning, never handed out), and a fact's KV record is bound to its text."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from capsule.errors import CapsuleCorrupt
from capsule.store import FactCorrupt, Store
from capsule.store import factdb, factrecord
from capsule.store.errors import DamagedFactWarning, FactRowCorrupt
from capsule.store.records import RECORD_HEADER
from test_store_facts import FACTS, KEY, add_all, fact_records, kv, sql

# (the field the damage is reported under, the damage); each leaves fact 2 damaged
DAMAGE = [("tags", "tags = '{not json'"), ("tags", "tags = '[1, 2]'"), ("tags", "tags = '\"charger\"'"),
          ("text", "text = x'4142'"), ("text", "text = ''"), ("text", "text = CAST(x'ff' AS TEXT)"),
          ("n_tokens", "n_tokens = 'many'"), ("n_tokens", "n_tokens = -3"),
          ("fingerprint", "fingerprint = ''"), ("rope", "rope = x'00'"), ("created", "created = 'yesterday'"),
          ("embedding", "embedding = NULL"), ("embedding", "embedding = x''"), ("embedding", "embedding = 'blob?'"),
          ("kv_version", "kv_version = 0"), ("kv location", "kv_segment = 'x'"), ("id", "id = -2")]


def _store(path: Path) -> None:
    with Store.open(path) as st:
        for i in add_all(st, 100):
            st.set_fact_embedding(i, bytes([i]) * 16, "minilm")


def _quiet(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # a warning here fails the test
        return call()


@pytest.mark.parametrize("field, damage", DAMAGE)
def test_a_damaged_row_is_skipped_with_a_warning_and_the_others_work(tmp_path, field, damage):
    _store(tmp_path / "s")
    sql(tmp_path / "s", f"UPDATE facts SET {damage} WHERE id = 2")
    bad = -2 if field == "id" else 2
    with Store.open(tmp_path / "s") as st:
        with pytest.warns(DamagedFactWarning, match=rf"memory fact {bad} is damaged and was skipped: .*\b{field}: "):
            infos = st.facts()
        assert [f.id for f in infos] == [1, 3, 4, 5] and infos[0].tags == FACTS[0][1]
        with warnings.catch_warnings(record=True):    # (a row without an embedding is not read)
            warnings.simplefilter("always")
            assert [e[0] for e in st.fact_embeddings()] == [1, 3, 4, 5]
        assert [(i, why.split(":")[0]) for i, why in st.damaged_facts()] == [(bad, field)]
        assert st.fact_kv(3) == kv(2, 100) and st.search_facts("charger", 5)[0][0] == 1
        assert _quiet(lambda: st.facts([3, 1])) == [infos[0], infos[1]]
        if field == "id":
            return                          # not an id any call can name (ids are >= 1)
        with pytest.warns(DamagedFactWarning):
            assert st.facts([2, 3]) == [infos[1]]
        with pytest.raises(FactRowCorrupt, match=rf"^fact 2: its index row is damaged: {field}: .*forget it") as err:
            st.fact_kv(2)
        assert (err.value.fact_id, isinstance(err.value, CapsuleCorrupt)) == (2, True)
        report = st.verify()                # never raises, whatever the row holds
        assert not report.ok and 2 in report.facts_bad
        assert any(p.startswith("fact 2: index row: ") for p in report.problems)
        st.forget_fact(2)                   # the way out
        assert _quiet(st.facts) == infos and st.damaged_facts() == [] and st.verify().ok


def test_search_without_fts5_skips_a_damaged_row(tmp_path, monkeypatch):
    monkeypatch.setattr(factdb, "fts5_available", lambda: False)
    _store(tmp_path / "s")
    sql(tmp_path / "s", "UPDATE facts SET tags = '{not json' WHERE id = 1")
    with Store.open(tmp_path / "s") as st:
        with pytest.warns(DamagedFactWarning, match="memory fact 1 "):
            assert st.search_facts("charger", 3) == []
        with pytest.warns(DamagedFactWarning):
            assert st.search_facts("fragile cup", 3)[0][0] == 2


@pytest.mark.skipif(not factdb.fts5_available(), reason="needs SQLite FTS5")
def test_facts_fts_made_late_over_a_damaged_row(tmp_path):
    _store(tmp_path / "s")
    sql(tmp_path / "s", "DROP TABLE facts_fts", "UPDATE facts SET tags = '{', text = CAST(x'ff' AS TEXT) WHERE id = 1")
    with Store.open(tmp_path / "s") as st:        # refills facts_fts from the rows: the open works
        assert st.search_facts("fragile", 3)[0][0] == 2
        with pytest.warns(DamagedFactWarning, match="memory fact 1 .*text: fact text must be a non-empty str, got "
                                                    "<SQLite text that is not UTF-8"):
            assert [f.id for f in st.facts()] == [2, 3, 4, 5]


def test_set_fact_kv_repairs_what_it_rewrites_and_refuses_other_damage(tmp_path):
    _store(tmp_path / "s")
    sql(tmp_path / "s", "UPDATE facts SET n_tokens = 'many', fingerprint = '', kv_offset = 'x' WHERE id = 2",
        "UPDATE facts SET tags = '{' WHERE id = 3")
    with Store.open(tmp_path / "s") as st:
        st.set_fact_kv(2, n_tokens=4, fingerprint="f2", rope="r2", kv=b"re-encoded")
        assert st.fact_kv(2) == b"re-encoded" and [i for i, _ in st.damaged_facts()] == [3]
        records = st.verify().records
        with pytest.raises(FactRowCorrupt, match="fact 3: its index row is damaged: tags: "):
            st.set_fact_kv(3, n_tokens=4, fingerprint="f", rope="r", kv=b"x")
        assert st.verify().records == records      # nothing written
    with Store.open(tmp_path / "s") as st:
        with pytest.warns(DamagedFactWarning, match="memory fact 3 "):
            assert [(f.id, f.n_tokens, f.fingerprint) for f in st.facts([2, 3])] == [(2, 4, "f2")]


def test_structural_damage_stays_a_typed_error(tmp_path):
    _store(tmp_path / "s")
    sql(tmp_path / "s", "ALTER TABLE facts RENAME TO facts_old",
        "CREATE TABLE facts (id INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT)")
    with Store.open(tmp_path / "s") as st:    # the first read finds the table broken: rebuilt from the log
        assert [f.text for f in st.facts()] == [t for t, _ in FACTS] and st.fact_kv(1) == kv(0, 100)
        assert any("no such column" in line for line in st.recovery_report)   # said, not silent
        assert st.fact_embeddings() == [] and st.damaged_facts() == []          # embeddings: a cache


@pytest.mark.parametrize("key", [None, KEY])
def test_an_edited_text_is_detected_through_the_text_binding(tmp_path, key):
    with Store.open(tmp_path / "s", sign_key=key) as st:
        add_all(st, 100)
    for seg, off, head in fact_records(tmp_path / "s"):   # each record names its fact's text
        start = off + RECORD_HEADER.size + head.name_len
        meta, data = factrecord.decode(seg.read_bytes()[start:start + head.payload_len])
        assert meta.text == FACTS[head.index - 1][0] and bytes(data) == kv(head.index - 1, 100)
    sql(tmp_path / "s", "UPDATE facts SET text = 'The charger is in bay 9 next to the workbench.' WHERE id = 1")
    with Store.open(tmp_path / "s", sign_key=key) as st:
        assert _quiet(st.facts)[0].text.startswith("The charger is in bay 9")   # listings read no records
        with pytest.raises(FactRowCorrupt, match="fact 1: .*text: text differs from the text its KV record was "
                                                 "encoded from .*edited in index.sqlite"):
            st.fact_kv(1)
        with pytest.raises(FactRowCorrupt, match="fact 1: .*text differs"):   # no re-encoding of it either
            st.set_fact_kv(1, n_tokens=1, fingerprint="f", rope="r", kv=b"x")
        assert st.fact_kv(2) == kv(1, 100)
    sql(tmp_path / "s", f"UPDATE facts SET text = '{FACTS[0][0]}' WHERE id = 1")
    with Store.open(tmp_path / "s", sign_key=key) as st:
        assert st.fact_kv(1) == kv(0, 100) and st.verify().ok


def test_records_written_before_the_text_binding_still_read(tmp_path, monkeypatch):
    monkeypatch.setattr(factrecord, "encode", lambda meta, data: bytes(data))  # the writer before bindings
    with Store.open(tmp_path / "s") as st:
        add_all(st, 100)
    monkeypatch.undo()
    sql(tmp_path / "s", "UPDATE facts SET text = 'edited' WHERE id = 1")
    with Store.open(tmp_path / "s") as st:
        assert [st.fact_kv(i) for i in (1, 2)] == [kv(0, 100), kv(1, 100)]   # unbound: not checkable
        st.set_fact_kv(2, n_tokens=1, fingerprint="f", rope="r", kv=b"new")  # binds from now on
        assert st.fact_kv(2) == b"new" and st.verify().ok
    sql(tmp_path / "s", "UPDATE facts SET text = 'edited too' WHERE id = 2")
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(FactRowCorrupt, match="fact 2: .*text differs"):
            st.fact_kv(2)


def test_a_damaged_record_can_still_be_re_encoded(tmp_path):
    with Store.open(tmp_path / "s") as st:
        add_all(st, 100)
    seg, off, head = [r for r in fact_records(tmp_path / "s") if r[2].index == 2][0]
    data = bytearray(seg.read_bytes())
    data[off + RECORD_HEADER.size + head.name_len + 3] ^= 1       # inside the text binding
    seg.write_bytes(bytes(data))
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(FactCorrupt, match="checksum mismatch"):
            st.fact_kv(2)
        st.set_fact_kv(2, n_tokens=1, fingerprint="f", rope="r", kv=b"again")
        assert st.fact_kv(2) == b"again"


def test_recall_and_injection_survive_damaged_facts(tmp_path):
    from capsule import Session

    def session():
        return Session.open(tmp_path / "s", model="builtin:tiny", memory={"embedder": None},
                            runtime={"kv_pool_mb": 16, "max_context": 1024})
    with session() as s:
        ids = [s.remember(t) for t in ("The charger is in bay 2.", "The spare charger is in bay 7.",
                                       "The old charger is in bay 5.", "Alice likes green tea.")]
    sql(tmp_path / "s", f"UPDATE facts SET tags = '{{not json' WHERE id = {ids[0]}",
        f"UPDATE facts SET text = 'The charger is in bay 9.' WHERE id = {ids[1]}")
    with session() as s:
        with pytest.warns(DamagedFactWarning, match=f"memory fact {ids[0]} "):
            got = s.recall("where is the charger", k=4)
        assert {f.id for f in got} == {ids[1], ids[2]}       # the edited one is listed, its KV refused:
        s.append("user: where is the charger?")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s.generate(1, memory_k=3)
        assert s.engine.streams["main"].region.fact_ids == (ids[2],)
        assert any(f"memory fact {ids[1]} is damaged" in str(w.message) for w in caught)


def test_store_verify_reports_damaged_rows(tmp_path):
    import sqlite3

    from capsule.store import Store
    with Store.open(tmp_path / "s") as st:
        good = st.add_fact("The cup is red.", n_tokens=3, fingerprint="m", rope="r", kv=b"x" * 8)
        bad = st.add_fact("The mat is wet.", n_tokens=3, fingerprint="m", rope="r", kv=b"y" * 8)
        assert st.verify().ok
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    con.execute("UPDATE facts SET tags='{not json' WHERE id=?", (bad,))
    con.commit()
    con.close()
    with Store.open(tmp_path / "s") as st:
        report = st.verify()
        assert not report.ok and bad in report.facts_bad and good not in report.facts_bad
        assert any(f"fact {bad}: index row" in p for p in report.problems)
