"""Failures during checkpoints and generation: nothing acknowledged lost, nothing wrong restored."""
from __future__ import annotations

import json

import pytest
import torch

from capsule import CapsuleCorrupt, Session
from capsule.errors import StoreError
from capsule.store import Store
from capsule.store.errors import StoreIOError

RT = {"kv_pool_mb": 8, "max_context": 1024}
TEXT = "user: the charger is in bay 2; the red cup is fragile.\n" * 6


def _fail_once(obj, attr, exc):
    real = getattr(obj, attr)
    state = {"armed": True}

    def wrapper(*a, **kw):
        if state["armed"]:
            state["armed"] = False
            raise exc
        return real(*a, **kw)
    setattr(obj, attr, wrapper)


def test_background_write_failure_is_raised_and_the_next_epoch_is_complete(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TEXT)
        s.generate(2)
        s.checkpoint(wait=False)
        s.flush()
        _fail_once(s.store, "stage_epoch", StoreIOError("injected: no space left on device"))
        s.generate(20)
        s.checkpoint(wait=False)                  # fails on the writer thread
        with pytest.raises(StoreError, match="no space left") as err:
            s.flush()
        assert "were not committed" in str(err.value)
        s.generate(3)
        epoch = s.checkpoint()                    # a full capsule, standing on its own
        assert epoch == 2 and s.epochs()[-1].base == 0
        want = s.tokens()
        want_kv = s.registry["kv_pool"].tensor.clone()
        blocks = list(s.engine.stream("main").table.blocks)
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        assert s.restored_epoch == 2 and s.tokens() == want
        kv = s.registry["kv_pool"].tensor
        assert torch.equal(kv[blocks], want_kv[blocks])


def test_a_failed_capture_does_not_lose_dirty_blocks(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TEXT)
        s.generate(2)
        s.checkpoint()
        s.generate(40)                            # dirties new blocks
        _fail_once(s.checkpointer.snap, "capture", MemoryError("injected"))
        with pytest.raises(MemoryError):
            s.checkpoint()
        s.checkpoint()
        blocks = list(s.engine.stream("main").table.blocks)
        want_kv = s.registry["kv_pool"].tensor[blocks].clone()
        want = s.tokens()
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        assert s.tokens() == want
        assert torch.equal(s.registry["kv_pool"].tensor[blocks], want_kv)


def test_fresh_start_over_an_old_store_does_not_inherit_its_pages(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TEXT * 3)
        s.generate(2)
        s.checkpoint()
    with Session.open(tmp_path / "s", device="cpu", runtime={**RT, "kv_pool_mb": 4}, restore=False) as s:
        s.append("hello")
        s.generate(2)
        assert s.checkpoint() == 2 and s.epochs()[-1].base == 0
        want = s.tokens()
    with Session.open(tmp_path / "s", device="cpu", runtime={**RT, "kv_pool_mb": 4}) as s:
        assert s.restored_epoch == 2 and s.tokens() == want


def test_a_failing_step_keeps_ids_and_text_together(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TEXT)
        n0 = len(s.tokens())
        runner = s.engine.runner
        real, calls = runner.decode, []

        def flaky(rows):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected device error")
            return real(rows)
        runner.decode = flaky
        with pytest.raises(RuntimeError):
            s.generate(10)
        generated = s.tokens()[n0:]
        assert len(generated) == 3
        assert s.text() == TEXT + s.tokenizer.decode(generated)


def test_unassigned_vocabulary_ids_are_never_sampled(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("x")
        runner = s.engine.runner
        real = runner.decode

        def biased(rows):
            logits = real(rows)
            logits[:, 100261] = 1e4              # an id cl100k_base does not assign
            return logits
        runner.decode = biased
        s.generate(5)
        assert 100261 not in s.tokens()


def test_rejected_append_leaves_no_stream_and_rejected_generate_keeps_generators(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        with pytest.raises(ValueError, match="max_context"):
            s.append("word " * 2000, stream="big")
        assert "big" not in s.streams()
        with pytest.raises(ValueError, match="longer than"):
            s.append("x", stream="n" * 300)
        s.append("a", stream="a")
        s.generate(2, stream="a", temperature=1.0, seed=1)
        state = s.engine.stream("a").generator.get_state()
        s.append("word " * 300, stream="b")        # a fits 800 more tokens, b does not
        with pytest.raises(ValueError, match="max_context"):
            s.generate(800, stream=["a", "b"], temperature=1.0, seed=2)
        assert torch.equal(s.engine.stream("a").generator.get_state(), state)
        for bad in ("1", 2**70, -1, True):
            with pytest.raises(ValueError, match="seed"):
                s.generate(1, stream="a", seed=bad)


def test_app_state_must_round_trip_exactly(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        for bad in ({1: "int key"}, {"pose": (0.1, 0.2)}):
            with pytest.raises(ValueError, match="unchanged"):
                s.state = bad


@pytest.mark.parametrize("edit", [
    lambda m: m["host"]["streams"][0].update(num_cached=-1),
    lambda m: m["host"]["streams"][0].update(generator_device="cuda:7"),
    lambda m: m["host"]["streams"][0].update(n_ids="many"),
    lambda m: m["blobs"].update({"ids/main": "big"}),
    lambda m: m["host"].update(streams={"not": "a list"}),
])
def test_tampered_manifest_is_corrupt_not_a_crash(tmp_path, edit):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TEXT)
        s.generate(3, temperature=0.5, seed=1)
        s.checkpoint()
        want = s.tokens()
    with Store.open(tmp_path / "s", create=False) as store:
        manifest, _ = store.load_epoch(1)
        doc = json.loads(manifest)
        edit(doc)
        store.write_epoch([], json.dumps(doc).encode(), base=1)
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:   # skipped with a report, never used
        assert s.restored_epoch == 1 and s.tokens() == want and s.restore_report[0].startswith("epoch 2")
        with pytest.raises(CapsuleCorrupt):
            s.rollback(2)
        assert s.tokens() == want
