"""runtime.context_policy: "error" (ContextFull, nothing changed) and "shift" (llama.cpp-style
context shift: oldest non-system tokens dropped, kept K/V moved with re-rotated keys), and the
capsule contract on shifted streams (checkpoint, restore in a new Session, continue bit-exactly)."""
from __future__ import annotations

import pytest
import torch

from capsule import CapacityError, ContextFull, Session
from capsule.llm.rope import inv_frequencies

SHIFT = {"max_context": 256, "context_policy": "shift"}
ERROR = {"max_context": 256, "context_policy": "error"}
SYSTEM = "system: you are a careful robot arm.\n"
MEMORY = {"embedder": None, "region_tokens": 64, "max_fact_tokens": 64}


def _open(path, runtime=SHIFT, **kw):
    return Session.open(str(path), model="builtin:tiny", device="cpu", runtime=runtime, **kw)


def _turn(i: int) -> str:
    return f"user: move block {i} to bay {i % 7}, then report\nassistant:"


def _kv(s: Session, positions, name="main") -> torch.Tensor:
    """The stream's K/V at positions: (n, L, 2, KV, hd), a copy."""
    st, pool = s.engine.streams[name], s.engine.pool
    bs = pool.block_size
    return torch.stack([pool.tensor[st.table.blocks[p // bs], :, :, p % bs].clone() for p in positions])


def _canonical_exact(s: Session, name="main") -> bool:
    tok = s.engine.streams[name].tok
    return tok.ids == s.tokenizer.encode(tok.text)


def _until_shift(s: Session, start: int = 0, gen=lambda s: s.generate(6), limit: int = 100) -> int:
    """Turns until the stream has shifted once more; returns the next turn's number."""
    before = s.engine.shifts.get("main", 0)
    for i in range(start, start + limit):
        s.append(_turn(i))
        gen(s)
        if s.engine.shifts.get("main", 0) > before:
            return i + 1
    raise AssertionError("no shift happened")


def test_error_policy_raises_context_full_naming_the_ways_out(tmp_path):
    with _open(tmp_path / "s", ERROR) as s:
        s.append(SYSTEM, system=True)
        def state():
            st = s.engine.streams["main"]
            return s.tokens(), s.text(), st.table.num_cached, list(st.table.blocks)
        with pytest.raises(ContextFull) as err:
            for i in range(200):
                before = state()
                s.append(_turn(i))
                before = state()
                s.generate(6)
        assert isinstance(err.value, CapacityError) and isinstance(err.value, ValueError)
        msg = str(err.value)
        for part in ("'main'", "max_context is 256", "Session.drop_stream('main')", "Session.rollback(",
                     "'context_policy': 'shift'", "positions"):
            assert part in msg, (part, msg)
        assert state() == before and s.engine.shifts == {}
        with pytest.raises(ContextFull, match="would span .* positions"):    # and at append
            s.append("word " * 300)
        assert s.tokens()[:len(before[0])] == before[0] and s.text() == before[1]


@pytest.mark.slow
def test_long_conversation_runs_500_turns_under_shift(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append(SYSTEM, system=True)
        system_ids = s.tokenizer.encode(SYSTEM)
        shifts = 0
        for i in range(500):
            s.append(_turn(i))
            # after every append (a shift folds and re-encodes) ids are the reference's
            assert s.tokens() == s.tokenizer.encode(s.text())
            assert s.text().startswith(SYSTEM) and s.tokens()[:len(system_ids)] == system_ids
            s.generate(1 if i % 10 else 6)    # short replies: each step costs a 100K-row lm_head
            if i % 25 == 0:
                s.generate(6)                 # a reply after a reply: shifts fold pending text
            st = s.engine.streams["main"]
            assert st.table.slot_end(st.n_ids) <= 256 and _canonical_exact(s)
            n = s.engine.shifts.get("main", 0)
            if n > shifts:
                shifts = n
                plan = s.engine.last_shift
                assert plan.head == len(system_ids) and plan.dropped >= (plan.n_ids + plan.dropped
                                                                         - plan.head) // 3
        assert shifts >= 40 and _turn(499) in s.text()
        assert len(s.engine.streams["main"].table.blocks) <= 256 // 16


def test_shift_moves_kept_kv_with_rotated_keys_and_frees_blocks(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append(SYSTEM, system=True)
        i = 0
        while True:   # fill the stream close to max_context without shifting
            s.append(_turn(i))
            s.generate(6)
            i += 1
            if s.engine.streams["main"].n_ids > 200:
                break
        assert s.engine.shifts == {}
        st, pool = s.engine.streams["main"], s.engine.pool
        old_ids, n_cached = s.tokens(), st.table.num_cached
        old_kv = _kv(s, range(n_cached))
        free = pool.free_blocks
        s.append("user: " + "stack the red blocks, " * 12 + "\nassistant:")   # does not fit
        assert s.engine.shifts == {"main": 1}
        plan = s.engine.last_shift
        head, cut, d = plan.head, plan.cut, plan.dropped
        assert head == len(s.tokenizer.encode(SYSTEM)) and d > 0 and plan.moved > 0
        assert s.tokens() == old_ids[:head] + s.tokens()[head:] == s.tokenizer.encode(s.text())
        assert s.tokens()[head:head + plan.moved] == old_ids[cut:cut + plan.moved]
        assert st.table.num_cached == head + plan.moved and pool.free_blocks > free
        new_kv = _kv(s, range(head + plan.moved))
        assert torch.equal(new_kv[:head], old_kv[:head])                 # the prefix stays
        moved_old = old_kv[cut:cut + plan.moved]
        assert torch.equal(new_kv[head:, :, 1], moved_old[:, :, 1])      # values unchanged
        # keys: the key of position p un-rotated, then rotated to p - d (float64 reference)
        cfg = s.engine.runner.model.cfg
        inv = inv_frequencies(cfg.rope, cfg.head_dim).double()

        def rot(x, pos):   # (n, L, KV, hd) rotated by per-token angles pos
            ang = torch.cat((torch.outer(pos, inv),) * 2, dim=-1)[:, None, None]
            half = x.shape[-1] // 2
            return x * ang.cos() + torch.cat((-x[..., half:], x[..., :half]), -1) * ang.sin()
        p = torch.arange(cut, cut + plan.moved, dtype=torch.float64)
        pre = rot(moved_old[:, :, 0].double(), -p)
        got = new_kv[head:, :, 0].double()
        assert torch.allclose(got, rot(pre, p - d), atol=1e-5, rtol=1e-4)
        assert not torch.allclose(got, rot(pre, p - d + 1), atol=1e-5, rtol=1e-4)   # one off: caught
        s.generate(4)                                                     # and it decodes on


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "seeded"])
def test_shifted_stream_restores_and_continues_bit_exactly(tmp_path, system, sampling):
    kw = {"temperature": 0.9, "top_p": 0.95} if sampling else {}

    def gen(s, **extra):
        return s.generate(6, **kw, **extra)

    def continuation(s):
        out, shifts = [], s.engine.shifts.get("main", 0)
        for j in range(8):            # more shifts happen on the way
            s.append(_turn(1000 + j))
            out.append(gen(s))
        return out, s.tokens(), s.text(), s.engine.shifts.get("main", 0) - shifts

    with _open(tmp_path / "s") as a:
        if system:
            a.append(SYSTEM, system=True)
        a.append(_turn(-1))
        gen(a, seed=7) if sampling else gen(a)
        _until_shift(a, gen=gen)
        a.checkpoint()
        ids_at_checkpoint = a.tokens()
        expect = continuation(a)
    assert expect[3] >= 1
    with _open(tmp_path / "s") as b:
        assert b.restored_epoch is not None and b.tokens() == ids_at_checkpoint
        got = continuation(b)
    assert got == expect
    if system:
        assert got[2].startswith(SYSTEM)


def test_rollback_to_an_epoch_before_a_shift_restores_the_unshifted_stream(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append(SYSTEM, system=True)
        nxt = _until_shift(s)
        st = s.engine.streams["main"]
        while st.table.slot_end(st.n_ids) < 200:
            s.append(_turn(nxt))
            s.generate(6)
            nxt += 1
        shifts = s.engine.shifts["main"]
        epoch = s.checkpoint()
        before = (s.tokens(), s.text(), st.table.num_cached)
        kv = _kv(s, range(st.table.num_cached))
        reply = s.generate(8)
        s.rollback(epoch)
        for j in range(6):
            s.append(_turn(500 + j))
            s.generate(8)
        assert s.engine.shifts["main"] > shifts
        s.rollback(epoch)
        st = s.engine.streams["main"]
        assert (s.tokens(), s.text(), st.table.num_cached) == before
        assert torch.equal(_kv(s, range(st.table.num_cached)), kv)
        assert s.generate(8) == reply


def test_a_generate_that_does_not_fit_folds_the_reply_and_shifts(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append(SYSTEM, system=True)
        s.append(_turn(0))
        st = s.engine.streams["main"]
        while st.table.slot_end(st.n_ids) + 8 <= 256:     # replies only: pending text grows
            s.generate(8)
        assert st.generated and st.pending
        text = s.text()
        s.generate(8)
        plan = s.engine.last_shift
        assert s.engine.shifts == {"main": 1} and plan.text == st.tok.text
        # the old reply joined the text before the cut: what is kept is the end of it
        assert text.endswith(plan.text[len(SYSTEM):]) and _canonical_exact(s)
        assert st.table.slot_end(st.n_ids) <= 256


def test_shift_with_a_memory_region_keeps_it_and_restores_bit_exactly(tmp_path):
    facts = ["The red cup is fragile.", "Bay 3 holds the spare batteries.", "The robot's name is Rex."]
    with _open(tmp_path / "s", memory=MEMORY) as a:
        for f in facts:
            a.remember(f)
        a.append(SYSTEM, system=True)
        a.append("user: where are the batteries?\nassistant:")
        a.generate(4, memory_k=2)
        st = a.engine.streams["main"]
        region = (st.region.start, st.region.size, list(st.region.facts))
        region_kv = _kv(a, range(*st.region.used))
        prefix_kv = _kv(a, range(st.region.gap_at))
        nxt = _until_shift(a, gen=lambda s: s.generate(6))         # the region as it is
        st = a.engine.streams["main"]
        assert (st.region.start, st.region.size, list(st.region.facts)) == region
        assert torch.equal(_kv(a, range(*st.region.used)), region_kv)
        assert torch.equal(_kv(a, range(st.region.gap_at)), prefix_kv)
        assert a.text().startswith(SYSTEM) and _canonical_exact(a)
        a.checkpoint()
        expect = []
        for j in range(8):
            a.append(_turn(nxt + j))
            expect.append(a.generate(6, memory_k=2))
        expect += [a.tokens(), a.engine.shifts["main"]]
    assert expect[-1] >= 2
    with _open(tmp_path / "s", memory=MEMORY) as b:
        got = []
        for j in range(8):
            b.append(_turn(nxt + j))
            got.append(b.generate(6, memory_k=2))
        got.append(b.tokens())
    assert got == expect[:-1]


def test_system_text_whose_last_token_joins_the_next_stays_whole(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append("system: you are a rob", system=True)
        s.append("ot arm. " + "Wait for orders. " * 4 + "\n")
        assert s.tokenizer.encode("system: you are a rob") != s.tokens()[:len(s.tokenizer.encode(
            "system: you are a rob"))]                                     # the seam token joins
        _until_shift(s)
        assert s.text().startswith("system: you are a robot") and _canonical_exact(s)


def test_shift_cannot_make_room_for_a_request_larger_than_the_context(tmp_path):
    with _open(tmp_path / "s") as s:
        s.append(SYSTEM, system=True)
        s.append(_turn(0))
        s.generate(4)
        before = (s.tokens(), s.text())
        with pytest.raises(ContextFull, match="cannot shift"):
            s.generate(250)
        assert (s.tokens(), s.text()) == before and s.engine.shifts == {}
        with pytest.raises(ContextFull, match="system prefix would not fit"):
            s.append("word " * 600, stream="sys", system=True)
        assert "sys" not in s.streams()
        s.append("word " * 600, stream="long")            # longer than the context: its end is kept
        assert s.text("long").endswith("word word ") and len(s.tokens("long")) <= 256
        assert s.tokens("long") == s.tokenizer.encode(s.text("long"))


def test_unknown_context_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="context_policy"):
        _open(tmp_path / "s", {"max_context": 256, "context_policy": "drop"})
    from capsule.llm.engine import Engine
    with _open(tmp_path / "t") as s:
        with pytest.raises(ValueError, match="context_policy"):
            Engine(s.engine.runner, s.engine.pool, s.tokenizer, context_policy="wrap")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shift_on_cuda_graphs_restores_and_continues_bit_exactly(tmp_path, dtype):
    rt = {**SHIFT, "kv_pool_mb": 16, "dtype": dtype, "cuda_graphs": True}

    def continuation(s):
        out = [s.generate(6, temperature=0.8) for _ in range(2)]   # a reply after a reply
        for j in range(8):
            s.append(_turn(1000 + j))
            out.append(s.generate(6, temperature=0.8))
        return out, s.tokens(), s.text()

    with Session.open(str(tmp_path / "s"), model="builtin:tiny", device="cuda", runtime=rt) as a:
        assert a.engine.runner.uses_graphs
        a.append(SYSTEM, system=True)
        a.append(_turn(-1))
        a.generate(4, temperature=0.8, seed=3)
        _until_shift(a, gen=lambda s: s.generate(6, temperature=0.8))
        a.checkpoint()
        ptrs = a.registry.data_ptrs()
        shifts = a.engine.shifts["main"]
        expect = continuation(a)
        assert a.engine.shifts["main"] > shifts and a.registry.data_ptrs() == ptrs
    with Session.open(str(tmp_path / "s"), model="builtin:tiny", device="cuda", runtime=rt) as b:
        assert continuation(b) == expect
