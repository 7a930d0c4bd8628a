"""Memory facts read back from a damaged index.sqlite: a damaged row is one damaged fact (skipped
with a warning, never handed out), and a fact's KV record holds its row, so an edited one is found."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from capsule.errors import CapsuleCorrupt
from capsule.memory import factsearch
from capsule.memory.facterrors import DamagedFactWarning, FactCorrupt, FactRowCorrupt
from capsule.memory.facttable import FactTable
from capsule.store import Store, keyedrecord
from capsule.store.records import RECORD_HEADER
from capsule.tools.store_report import verify_store
from test_memory_facts import FACTS, KEY, add_all, fact_records, kv, sql

# (the field the damage is reported under, the damage to fact 2's `records` row)
DAMAGE = [("tags", "row = json_set(row, '$.tags', '{not json')"), ("tags", "row = json_set(row, '$.tags', json('[1, 2]'))"),
          ("tags", "row = json_set(row, '$.tags', json('[\"\"]'))"),
          ("text", "row = json_set(row, '$.text', '')"), ("text", "row = json_remove(row, '$.text')"),
          ("row", "row = CAST(x'ff' AS TEXT)"), ("row", "row = x'4142'"), ("row", "row = '[1]'"),
          ("n_tokens", "row = json_set(row, '$.n_tokens', 'many')"), ("n_tokens", "row = json_set(row, '$.n_tokens', -3)"),
          ("fingerprint", "row = json_set(row, '$.fingerprint', '')"), ("rope", "row = json_set(row, '$.rope', 7)"),
          ("created", "row = json_set(row, '$.created', 'yesterday')"), ("version", "version = 0")]


def damage(path: Path, fid: int, what: str) -> None:
    sql(path, f"UPDATE records SET {what} WHERE collection = 'fact' AND id = {fid}")


def _store(path: Path) -> None:
    with Store.open(path) as st:
        for i in add_all(st, 100):
            FactTable(st).set_fact_embedding(i, bytes([i]) * 16, "minilm")


def _quiet(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # a warning here fails the test
        return call()


@pytest.mark.parametrize("field, what", DAMAGE)
def test_a_damaged_row_is_skipped_with_a_warning_and_the_others_work(tmp_path, field, what):
    _store(tmp_path / "s")
    damage(tmp_path / "s", 2, what)
    with Store.open(tmp_path / "s") as st:
        facts = FactTable(st)
        with pytest.warns(DamagedFactWarning, match=rf"memory fact 2 is damaged and was skipped: .*\b{field}: "):
            infos = facts.facts()
        assert [f.id for f in infos] == [1, 3, 4, 5] and infos[0].tags == FACTS[0][1]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert [e[0] for e in facts.fact_embeddings()] == [1, 3, 4, 5]
        assert [(i, why.split(":")[0]) for i, why in facts.damaged_facts()] == [(2, field)]
        assert facts.fact_kv(3) == kv(2, 100) and facts.search_facts("charger", 5)[0][0] == 1
        assert _quiet(lambda: facts.facts([3, 1])) == [infos[0], infos[1]]
        with pytest.warns(DamagedFactWarning):
            assert facts.facts([2, 3]) == [infos[1]]
        with pytest.raises(FactRowCorrupt, match=rf"^fact 2: its index row is damaged: {field}: .*forget it") as err:
            facts.fact_kv(2)
        assert (err.value.fact_id, isinstance(err.value, CapsuleCorrupt)) == (2, True)
        assert facts.count_facts() == 5                 # counted, never handed out
        facts.forget_fact(2)                            # the way out
        assert _quiet(facts.facts) == infos and facts.damaged_facts() == [] and st.verify().ok


@pytest.mark.parametrize("field, what", DAMAGE[:1] + DAMAGE[5:6])
def test_capsule_verify_lists_a_damaged_row(tmp_path, field, what):
    _store(tmp_path / "s")
    damage(tmp_path / "s", 2, what)
    ok, text = verify_store(tmp_path / "s")
    assert not ok and "problem: fact 2: index row: " in text   # (the others: their KV is no FactKV)


def test_a_damaged_record_location_is_a_damaged_record(tmp_path):
    _store(tmp_path / "s")
    damage(tmp_path / "s", 2, "segment = 'x'")
    with Store.open(tmp_path / "s") as st:
        assert [f.id for f in _quiet(FactTable(st).facts)] == [1, 2, 3, 4, 5]   # listings read no record
        with pytest.raises(FactCorrupt, match="fact 2: its KV record .*location is damaged"):
            FactTable(st).fact_kv(2)
        report = st.verify()
        assert not report.ok and ("fact", 2) in report.records_bad
        FactTable(st).set_fact_kv(2, n_tokens=4, fingerprint="f2", rope="r2", kv=b"again")   # the repair
        assert FactTable(st).fact_kv(2) == b"again" and st.verify().ok


def test_search_without_fts5_skips_a_damaged_row(tmp_path, monkeypatch):
    monkeypatch.setattr(factsearch, "fts5_available", lambda: False)
    _store(tmp_path / "s")
    damage(tmp_path / "s", 1, DAMAGE[0][1])
    with Store.open(tmp_path / "s") as st:
        facts = FactTable(st)
        with pytest.warns(DamagedFactWarning, match="memory fact 1 "):   # said when the index is built
            assert facts.search_facts("charger", 3) == []
        assert _quiet(lambda: facts.search_facts("fragile cup", 3))[0][0] == 2


def test_set_fact_kv_repairs_what_it_rewrites_and_refuses_other_damage(tmp_path):
    _store(tmp_path / "s")
    damage(tmp_path / "s", 2, "row = json_set(row, '$.n_tokens', 'many', '$.fingerprint', '')")
    damage(tmp_path / "s", 3, DAMAGE[0][1])
    with Store.open(tmp_path / "s") as st:
        facts = FactTable(st)
        facts.set_fact_kv(2, n_tokens=4, fingerprint="f2", rope="r2", kv=b"re-encoded")
        assert facts.fact_kv(2) == b"re-encoded" and [i for i, _ in facts.damaged_facts()] == [3]
        records = st.verify().records
        with pytest.raises(FactRowCorrupt, match="fact 3: its index row is damaged: tags: "):
            facts.set_fact_kv(3, n_tokens=4, fingerprint="f", rope="r", kv=b"x")
        assert st.verify().records == records      # nothing written
    with Store.open(tmp_path / "s") as st:
        with pytest.warns(DamagedFactWarning, match="memory fact 3 "):
            assert [(f.id, f.n_tokens, f.fingerprint) for f in FactTable(st).facts([2, 3])] == [(2, 4, "f2")]


def test_structural_damage_stays_a_typed_error(tmp_path):
    _store(tmp_path / "s")
    sql(tmp_path / "s", "ALTER TABLE records RENAME TO records_old",
        "CREATE TABLE records (collection TEXT, id INTEGER)")
    with Store.open(tmp_path / "s") as st:    # the first read finds the table broken: rebuilt from the log
        facts = FactTable(st)
        assert [f.text for f in facts.facts()] == [t for t, _ in FACTS] and facts.fact_kv(1) == kv(0, 100)
        assert any("no such column" in line for line in st.recovery_report)   # said, not silent
        assert facts.fact_embeddings() == [] and facts.damaged_facts() == []   # embeddings: a cache


@pytest.mark.parametrize("key", [None, KEY])
def test_an_edited_row_is_detected_through_its_record(tmp_path, key):
    with Store.open(tmp_path / "s", sign_key=key) as st:
        add_all(st, 100)
    for seg, off, head in fact_records(tmp_path / "s"):   # each record holds its fact's row
        start = off + RECORD_HEADER.size + head.name_len
        got, data = keyedrecord.decode(seg.read_bytes()[start:start + head.payload_len])
        assert got.row["text"] == FACTS[head.index - 1][0] and bytes(data) == kv(head.index - 1, 100)
    damage(tmp_path / "s", 1, "row = json_set(row, '$.text', 'The charger is in bay 9 next to the workbench.')")
    with Store.open(tmp_path / "s", sign_key=key) as st:
        facts = FactTable(st)
        assert _quiet(facts.facts)[0].text.startswith("The charger is in bay 9")   # listings read no records
        with pytest.raises(FactRowCorrupt, match="fact 1: .*differs from the row its record was written with"):
            facts.fact_kv(1)
        with pytest.raises(FactRowCorrupt, match="fact 1: .*text: .*differs"):   # no re-encoding of it either
            facts.set_fact_kv(1, n_tokens=1, fingerprint="f", rope="r", kv=b"x")
        assert facts.fact_kv(2) == kv(1, 100)
    damage(tmp_path / "s", 1, f"row = json_set(row, '$.text', '{FACTS[0][0]}')")
    with Store.open(tmp_path / "s", sign_key=key) as st:
        assert FactTable(st).fact_kv(1) == kv(0, 100) and st.verify().ok


def test_headless_records_of_older_sdks_still_read(tmp_path, monkeypatch):
    import hashlib
    with Store.open(tmp_path / "s") as st:
        real = keyedrecord.encode
        monkeypatch.setattr(keyedrecord, "encode", lambda sid, row, data: bytes(data))   # the writer before rows
        FactTable(st).add_fact(FACTS[0][0], n_tokens=1, fingerprint="f", rope="r", kv=kv(0, 100))
        bound = b"CPFTEXT\x01" + hashlib.sha256(FACTS[1][0].encode()).digest() + kv(1, 100)
        FactTable(st).add_fact(FACTS[1][0], n_tokens=1, fingerprint="f", rope="r", kv=bound)
        monkeypatch.setattr(keyedrecord, "encode", real)
    damage(tmp_path / "s", 1, "row = json_set(row, '$.text', 'edited')")
    with Store.open(tmp_path / "s") as st:
        assert [FactTable(st).fact_kv(i) for i in (1, 2)] == [kv(0, 100), kv(1, 100)]   # 1: unbound, not checkable
        FactTable(st).set_fact_kv(1, n_tokens=1, fingerprint="f", rope="r", kv=b"new")  # holds its row from now on
        assert FactTable(st).fact_kv(1) == b"new" and st.verify().ok
    damage(tmp_path / "s", 2, "row = json_set(row, '$.text', 'edited too')")
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(FactRowCorrupt, match="fact 2: .*text differs"):   # the text binding says so
            FactTable(st).fact_kv(2)
        with pytest.raises(FactRowCorrupt, match="fact 2: .*text differs"):
            FactTable(st).set_fact_kv(2, n_tokens=1, fingerprint="f", rope="r", kv=b"x")
        st.repair()                          # headless: a rebuild cannot bring their rows back
        assert FactTable(st).count_facts() == 1 and any("older SDK" in r for r in st.recovery_report)


def test_a_damaged_record_can_still_be_re_encoded(tmp_path):
    with Store.open(tmp_path / "s") as st:
        add_all(st, 100)
    seg, off, head = [r for r in fact_records(tmp_path / "s") if r[2].index == 2][0]
    data = bytearray(seg.read_bytes())
    data[off + RECORD_HEADER.size + head.name_len + 3] ^= 1       # inside the record's head
    seg.write_bytes(bytes(data))
    with Store.open(tmp_path / "s") as st:
        with pytest.raises(FactCorrupt, match="checksum mismatch"):
            FactTable(st).fact_kv(2)
        FactTable(st).set_fact_kv(2, n_tokens=1, fingerprint="f", rope="r", kv=b"again")
        assert FactTable(st).fact_kv(2) == b"again"


def test_recall_and_injection_survive_damaged_facts(tmp_path):
    from capsule import Session

    def session():
        return Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", memory={"embedder": None},
                            runtime={"kv_pool_mb": 16, "max_context": 1024})
    with session() as s:
        ids = [s.remember(t) for t in ("The charger is in bay 2.", "The spare charger is in bay 7.",
                                       "The old charger is in bay 5.", "Alice likes green tea.")]
    damage(tmp_path / "s", ids[0], DAMAGE[0][1])
    damage(tmp_path / "s", ids[1], "row = json_set(row, '$.text', 'The charger is in bay 9.')")
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


def test_store_verify_reports_rows_that_are_not_rows(tmp_path):
    with Store.open(tmp_path / "s") as st:
        good = FactTable(st).add_fact("The cup is red.", n_tokens=3, fingerprint="m", rope="r", kv=b"x" * 8)
        bad = FactTable(st).add_fact("The mat is wet.", n_tokens=3, fingerprint="m", rope="r", kv=b"y" * 8)
        assert st.verify().ok
    damage(tmp_path / "s", bad, "row = '{not json'")
    with Store.open(tmp_path / "s") as st:
        report = st.verify()
        assert not report.ok and ("fact", bad) in report.records_bad and ("fact", good) not in report.records_bad
