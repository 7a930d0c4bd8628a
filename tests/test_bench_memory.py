"""The memory benchmark suite runs end to end on tiny sizes; `capsule memory reencode` re-encodes facts."""
from __future__ import annotations

import json
import math

import capsule.tools.bench.memory as memory_suite
from capsule import Session
from capsule.tools.bench import SUITES, BenchOptions, run_suite
from capsule.cli import main


def test_memory_suite_quick(tmp_path, monkeypatch):
    # small counts keep this test well under a minute on a 2-core machine
    monkeypatch.setattr(memory_suite, "QUICK_RECALL_FACTS", 300)
    monkeypatch.setattr(memory_suite, "QUICK_REMEMBERED", 20)
    monkeypatch.setattr(memory_suite, "QUICK_QUERIES", 10)
    assert "memory" in SUITES
    opts = BenchOptions(model="builtin:tiny", device="cpu", quick=True, steps=1, progress=False)
    run = run_suite("memory", opts, out_dir=tmp_path)
    data = json.loads(run.json_path.read_text())
    assert "| k | fact_tokens |" in run.md_path.read_text()
    assert data["settings"]["ks"] == [1, 10, 50] and data["settings"]["ttft_reps"] == 1
    res = data["results"]
    assert [r["k"] for r in res["ttft"]] == [1, 10, 50]
    for r in res["ttft"]:
        assert r["injected_ttft_ms"] > 0 and r["prefill_ttft_ms"] > 0
        assert isinstance(r["ratio_prefill_over_injected"], float)
        assert math.isfinite(r["ratio_prefill_over_injected"]) and r["ratio_prefill_over_injected"] > 0
        assert r["prefill_stream_tokens"] == r["injected_stream_tokens"] + r["fact_tokens"]
    dec = res["decode"]
    assert [r["region_tokens"] for r in dec] == [0, 512, 2048]
    assert dec[0]["empty_region_blocks"] == 0 and all(r["empty_region_blocks"] > 0 for r in dec[1:])
    assert all(r["step_ms"] > 0 and r["step_ms_reading_all_blocks"] > 0 for r in dec)
    assert len(res["targets"]) == 3 and [t["met"] in ("yes", "NO") for t in res["targets"]] == [True, True, False]
    g = res["growth"]
    assert (g["k_low"], g["k_high"], g["reps"]) == (1, 50, 1) and g["growth"] == g["high_ms"] / g["low_ms"] > 0
    modes = {r["mode"]: r for r in res["recall"]}
    assert set(modes) == {"lexical (BM25)", "embedding only", "hybrid"}
    assert modes["lexical (BM25)"]["p50_ms"] > 0 and modes["lexical (BM25)"]["facts"] == 300
    for r in modes.values():
        if r["note"] == "no embedder":       # the MiniLM package is not installed
            assert r["p50_ms"] is None
        else:
            assert 0 < r["p50_ms"] <= r["p99_ms"] and 0 <= r["hit_at_k"] <= 1
    assert res["remember"]["remember_facts_per_s"] > 0
    dev = {r["window"]: r for r in res["deviation"]}
    assert set(dev) == {0, 32}
    for r in dev.values():
        assert r["facts"] == 10 and r["same_tokens"] is True
        assert math.isfinite(r["hidden_rel_err_mean"]) and 0 <= r["hidden_rel_err_mean"] <= r["hidden_rel_err_max"]
        assert 0 <= r["top1_agree"] <= 1


def test_make_facts_distinct_and_reproducible():
    a = memory_suite.make_facts(200, seed=7)
    assert a == memory_suite.make_facts(200, seed=7)
    assert len({t for t, _ in a}) == 200 and all(t.endswith("\n") for t, _ in a)


FACTS = ["The red cup is fragile.", "The charger is in bay 2.", "Alice likes green tea."]


def test_memory_reencode_cli(tmp_path, capsys):
    store = tmp_path / "s"
    with Session.open(store, model="builtin:tiny", device="cpu", memory={"embedder": None}) as s:
        for t in FACTS:
            s.remember(t)
        tiny_fp = s.memory.fingerprint
    argv = ["memory", "reencode", str(store), "--model", "builtin:small", "--device", "cpu"]
    assert main(argv) == 0
    assert "re-encoded 3 of 3 fact(s)" in capsys.readouterr().out
    assert main(argv) == 0                              # nothing left to do
    assert "re-encoded 0 of 3 fact(s)" in capsys.readouterr().out
    with Session.open(store, model="builtin:small", device="cpu", memory={"embedder": None}) as s:
        infos = s.memory.store.facts()
        assert {i.fingerprint for i in infos} == {s.memory.fingerprint} != {tiny_fp}
        s.append("user: where is the charger?\nassistant:")
        s.generate(2, memory_k=2)                       # the re-encoded K/V fit the small model
        assert len(s.engine.streams["main"].region.facts) == 2


def test_memory_reencode_repairs_a_damaged_fact(tmp_path, capsys):
    store = tmp_path / "s"
    with Session.open(store, model="builtin:tiny", device="cpu", memory={"embedder": None}) as s:
        ids = [s.remember(t) for t in FACTS]
    seg = sorted((store / "segments").glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    data[-40] ^= 0xFF                                  # inside the last fact's K/V payload
    seg.write_bytes(bytes(data))
    argv = ["memory", "reencode", str(store), "--model", "builtin:tiny", "--device", "cpu"]
    assert main(argv) == 0
    assert "re-encoded 1 of 3 fact(s)" in capsys.readouterr().out
    with Session.open(store, model="builtin:tiny", device="cpu", memory={"embedder": None}) as s:
        assert all(s.memory.kv(f) is not None for f in ids)
    # the model is never guessed: a store's facts are for the model you name
    assert main(["memory", "reencode", str(store), "--device", "cpu"]) == 2     # a usage error
    assert "--model" in capsys.readouterr().err


def test_memory_reencode_names_a_fact_with_a_damaged_row(tmp_path, capsys):
    import sqlite3
    store = tmp_path / "s"
    with Session.open(store, model="builtin:tiny", device="cpu", memory={"embedder": None}) as s:
        ids = [s.remember(t) for t in FACTS]
    con = sqlite3.connect(store / "index.sqlite")
    con.execute("UPDATE records SET row = json_set(row, '$.tags', '{not json') WHERE collection = 'fact' AND id = ?",
                (ids[1],))
    con.commit()
    con.close()
    assert main(["memory", "reencode", str(store), "--model", "builtin:small", "--device", "cpu"]) == 1
    out = capsys.readouterr()
    assert "re-encoded 2 of 3 fact(s)" in out.out and f"fact {ids[1]}: not re-encoded" in out.err


def test_memory_reencode_missing_store_is_a_one_line_error(tmp_path, capsys):
    assert main(["memory", "reencode", str(tmp_path / "missing"), "--model", "builtin:tiny",
                 "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a capsule store" in err and err.count("\n") == 1
    assert not (tmp_path / "missing").exists()
