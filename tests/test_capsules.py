"""Capsules: continuation in a fresh process, in-place rollback, binding mismatches."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capsule import CapsuleMismatch, Session
from hf_checkpoints import make_checkpoint

RT = {"kv_pool_mb": 16, "max_context": 2048}
TRANSCRIPT = "".join(f"user: step {i}: move the red cup {i * 7} cm left, then report.\nrobot: ok.\n"
                     for i in range(60))                                       # ~1.2K tokens

CHILD = r"""
import json, sys
from capsule import Session
a = json.loads(sys.argv[1])
with Session.open(a["store"], device="cpu", runtime=a["rt"]) as s:
    out = {"restored": s.restored_epoch, "state": s.state}
    out["replies"] = s.generate(a["m"], stream=a["streams"], temperature=a["t"], top_p=a["p"])
    out["tokens"] = {n: s.tokens(n) for n in a["streams"]}
print(json.dumps(out))
"""


def _child(**args) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("streams,temperature", [(["main"], 0.0), (["main"], 0.9),
                                                 (["a", "b", "c"], 0.0), (["a", "b", "c"], 0.9)])
def test_continuation_in_a_fresh_process(tmp_path, streams, temperature):
    store = tmp_path / "robot.capsules"
    with Session.open(store, device="cpu", runtime=RT) as s:
        for i, name in enumerate(streams):
            s.append(TRANSCRIPT[i * 100:], stream=name)
        assert len(s.tokens(streams[0])) > 1000
        s.generate(5, stream=streams, temperature=temperature, top_p=0.95, seed=123 if temperature else None)
        s.state = {"goal": "red cup", "step": 5}
        epoch = s.checkpoint()
        s.generate(9, stream=streams, temperature=temperature, top_p=0.95)
        want = {n: s.tokens(n) for n in streams}
    got = _child(store=str(store), rt=RT, streams=streams, m=9, t=temperature, p=0.95)
    assert got["restored"] == epoch
    assert got["state"] == {"goal": "red cup", "step": 5}
    assert got["tokens"] == want


def test_rollback_in_place_equals_a_run_that_never_went_past(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TRANSCRIPT[:2000])
        s.append("side stream", stream="side")
        s.generate(4, stream=["main", "side"])
        first = s.checkpoint(name="before")
        ptrs = s.registry.data_ptrs()
        a = s.generate(12, temperature=0.8, seed=5)
        tokens_a = s.tokens()
        s.append("more text that the rollback must forget")
        s.checkpoint()
        assert s.rollback("before") == first
        assert s.registry.data_ptrs() == ptrs
        assert s.streams() == ["main", "side"]
        b = s.generate(12, temperature=0.8, seed=5)
        assert (a, s.tokens()) == (b, tokens_a)
        # the epoch after a rollback is a small delta over the rolled-back-to epoch, and
        # reopening restores it exactly (nothing of the abandoned epoch shows through)
        s.generate(3)
        last = s.checkpoint()
        assert s.epochs()[-1].base == first
        # (a full capture would rewrite all ~40 KV blocks; the manifest lists every page it uses)
        assert s.epochs()[-1].bytes_written < 5 * s.registry["kv_pool"].page_bytes
        want = s.tokens()
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s2:
        assert s2.restored_epoch == last and s2.tokens() == want


def test_delta_epochs_write_only_dirty_pages(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append(TRANSCRIPT[:3000])
        s.generate(1)                                   # prefill: the first epoch holds all KV
        s.checkpoint()
        full = s.epochs()[-1].bytes_written
        s.generate(8)
        s.checkpoint()
        delta = s.epochs()[-1].bytes_written
    block = s.registry["kv_pool"].page_bytes
    assert delta < full / 4
    assert delta <= 2 * block + 3 * 4096 + 8192, delta   # <= 2 KV blocks + tail host pages + manifest


def test_restore_false_starts_empty_and_keeps_epochs(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("hello")
        s.checkpoint()
    with Session.open(tmp_path / "s", device="cpu", runtime=RT, restore=False) as s:
        assert s.restored_epoch is None and s.streams() == []
        assert [e.id for e in s.epochs()] == [1]


def test_restore_into_another_tokenizer_is_refused(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.append("hello")
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="tokenizer"):
        Session.open(tmp_path / "s", device="cpu", runtime=RT, tokenizer="qwen2.5")


def test_restore_into_another_model_seed_is_refused(tmp_path):
    a = make_checkpoint("llama", tmp_path / "a", vocab_size=100277, seed=0)
    b = make_checkpoint("llama", tmp_path / "b", vocab_size=100277, seed=1)
    with Session.open(tmp_path / "s", model=a, tokenizer="cl100k_base", device="cpu", runtime=RT) as s:
        s.append("hello")
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="model:") as err:
        Session.open(tmp_path / "s", model=b, tokenizer="cl100k_base", device="cpu", runtime=RT)
    assert "tokenizer:" not in str(err.value) and "layout:" not in str(err.value)


@pytest.mark.parametrize("wait", [True, False])
def test_retention_keeps_the_store_bounded_and_exact(tmp_path, wait):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT, keep_epochs=3) as s:
        s.append(TRANSCRIPT[:1500])
        for _ in range(30):
            s.generate(4)
            s.checkpoint(wait=wait)
        s.flush()
        assert [e.id for e in s.epochs()] == [28, 29, 30]
        want = s.tokens()
        size = sum(f.stat().st_size for f in (tmp_path / "s").rglob("*") if f.is_file())
        live = s.registry["kv_pool"].page_bytes * (-(-len(want) // 16))
        assert size < 6 * live + (1 << 20), (size, live)
    with Session.open(tmp_path / "s", device="cpu", runtime=RT, keep_epochs=3) as s:
        assert s.restored_epoch == 30 and s.tokens() == want
        assert s.rollback(28) == 28 and len(s.tokens()) == len(want) - 8


def test_checkpoint_refuses_a_mutated_non_json_state(tmp_path):
    with Session.open(tmp_path / "s", device="cpu", runtime=RT) as s:
        s.state["pose"] = object()
        with pytest.raises(ValueError, match="JSON"):
            s.checkpoint()
        s.state = {"pose": [0.1, 0.2]}
        assert s.checkpoint() == 1
