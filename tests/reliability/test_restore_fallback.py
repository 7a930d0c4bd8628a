"""Restore falls back to the newest usable epoch, reports it, and a failed rollback changes nothing.

Hostile epochs are made checksum-valid by writing them through the store itself (Store.open on a
closed Session's folder, write_epoch with an edited copy of a real manifest).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from capsule import CapsuleCorrupt, CapsuleMismatch, Session
from capsule.store import Store
from forged_epochs import forge, two_epochs
from hf_checkpoints import make_checkpoint

RT = {"kv_pool_mb": 8, "max_context": 1024}
TEXT = "user: the charger is in bay 2; bring the red cup.\n" * 6


def test_no_valid_epoch_at_all_is_corrupt_listing_each(tmp_path):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", runtime=RT) as s:
        s.append(TEXT)
        s.checkpoint()
    with Store.open(path, create=False) as store:   # replace the only epoch's view by bad ones
        store.write_epoch([], b"[1, 2")
        store.write_epoch([], b'{"binding": 7}')
        store.retain(2)
    with pytest.raises(CapsuleCorrupt, match="none is fully valid") as err:
        Session.open(path, device="cpu", runtime=RT)
    assert "epoch 2:" in str(err.value) and "epoch 3:" in str(err.value)


# -- a failed rollback changes nothing -------------------------------------------------------
def _obs(i: int) -> dict:
    return {"observation.state": np.random.default_rng(i).standard_normal(14).astype(np.float32)}


def _live(s: Session) -> dict:
    """Everything a rollback could change, copied."""
    engine = s.engine
    return {"streams": {n: (st.ids[:], st.text, st.table.blocks[:], st.table.num_cached,
                            None if st.generator is None else st.generator.get_state().clone())
                        for n, st in engine.streams.items()},
            # bytes, not values: a buffer may hold NaN (never equal to itself) or uninitialized bits
            "regions": {r.name: r.tensor.reshape(-1).view(torch.uint8).clone() for r in s.registry},
            "state": json.dumps(s.state), "queue": s.actor.state(), "free": engine.pool.free_blocks}


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return x == y
    return eq(a, b)


def _then(s: Session) -> tuple:
    """What the session does next: sampled tokens (its RNG), greedy tokens, actions."""
    return (s.generate(4), s.generate(5, temperature=0.9), s.tokens(), s.act(_obs(4)).tolist(),
            s.act(_obs(5)).tolist())


@pytest.mark.parametrize("policy", ["builtin:gru", "builtin:mlp-chunk"])
@pytest.mark.parametrize("edit", [
    # json writes NaN happily: before, the streams and K/V were installed, then the state failed
    lambda m: m["host"].update(app_state={"pose": float("nan")}),
    lambda m: m["host"].update(app_state=[1, 2]),
    lambda m: m["host"].update(policy={"queued": 99, "served": 1}),
    lambda m: m["host"]["streams"][0].update(n_ids=m["host"]["streams"][0]["n_ids"] + 1),
    lambda m: m["blobs"].update({"text/main": m["blobs"]["text/main"] + 1}),
], ids=["nan-state", "list-state", "queue-cursor", "n_ids", "blob-size"])
def test_a_failed_rollback_changes_nothing(tmp_path, policy, edit):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", runtime=RT, policy=policy) as s:
        s.append(TEXT)
        s.generate(3, temperature=0.8, seed=7)
        s.act(_obs(0))
        s.checkpoint()
        s.generate(2, temperature=0.8)
        s.act(_obs(1))
        s.state = {"step": 2}
        s.checkpoint()

    def hostile(m):
        edit(m)
        return json.dumps(m).encode()   # allow_nan: a checksum-valid capsule with NaN in it
    bad = forge(path, hostile, of=None)
    twin = tmp_path / "twin"
    shutil.copytree(path, twin)
    runs = []
    for folder, try_rollback in ((path, True), (twin, False)):
        with Session.open(folder, device="cpu", runtime=RT, policy=policy, restore=False) as s:
            assert s.rollback(2) == 2
            s.generate(3, temperature=0.8)                       # move on from the capsule
            s.act(_obs(2))
            s.state = {"step": 3}
            if try_rollback:
                before = _live(s)
                with pytest.raises(CapsuleCorrupt, match=f"epoch {bad}"):
                    s.rollback(bad)
                assert _same(_live(s), before)
                assert s.restored_epoch == 2
            runs.append(_then(s))
    assert runs[0] == runs[1]   # as if the rollback had never been attempted


# -- another model's epochs in the same store --------------------------------------------------
@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("b") / "model", vocab_size=100277, seed=1)


def _turn(s: Session, text: str) -> list[int]:
    s.append(text)
    s.generate(4)
    s.checkpoint()
    return s.tokens()


def test_two_models_share_a_store_each_restoring_its_own(tmp_path, model_b):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", runtime=RT) as a:
        a_tokens = _turn(a, TEXT)
    with pytest.raises(CapsuleMismatch) as err:
        Session.open(path, model=model_b, tokenizer="cl100k_base", device="cpu", runtime=RT)
    msg = str(err.value)
    # what a person recognises, for the capsule and for the session; and the way out
    assert "'builtin:tiny'" in msg and repr(str(model_b)) in msg and "restore=False" in msg
    assert "checkpoint(name=" in msg and "tokenizer:" not in msg
    with Session.open(path, model=model_b, tokenizer="cl100k_base", device="cpu", runtime=RT,
                      restore=False) as b:
        _turn(b, "user: B's first words.\n")
        b_tokens = _turn(b, "user: B again.\n")
    with Session.open(path, device="cpu", runtime=RT) as a:
        assert a.restored_epoch == 1 and a.tokens() == a_tokens
        assert [r.split(":")[0] for r in a.restore_report] == ["epoch 3", "epoch 2"]
        assert all("taken against a different setup" in r for r in a.restore_report)
        a_tokens = _turn(a, "user: A is back.\n")          # epoch 4, a delta over epoch 1
    with Session.open(path, model=model_b, tokenizer="cl100k_base", device="cpu", runtime=RT) as b:
        assert b.restored_epoch == 3 and b.tokens() == b_tokens
        assert b.restore_report and b.restore_report[0].startswith("epoch 4:")
    with Session.open(path, device="cpu", runtime=RT) as a:
        assert a.restored_epoch == 4 and a.tokens() == a_tokens and a.restore_report == []


def test_retention_counts_every_epoch_but_keeps_named_ones(tmp_path, model_b):
    """Decided: keep_epochs counts all epochs, whatever setup wrote them; a named epoch is never
    dropped, so naming is how two setups keep their capsules in one store."""
    path = tmp_path / "s"
    for name in (None, "a-home"):
        shutil.rmtree(path, ignore_errors=True)
        with Session.open(path, device="cpu", runtime=RT, keep_epochs=2) as a:
            a.append(TEXT)
            a.generate(3)
            a.checkpoint(name=name)
            a_tokens = a.tokens()
        with Session.open(path, model=model_b, tokenizer="cl100k_base", device="cpu", runtime=RT,
                          restore=False, keep_epochs=2) as b:
            for i in range(3):
                _turn(b, f"user: B turn {i}.\n")
            kept = [e.id for e in b.epochs()]
        if name is None:
            assert kept == [3, 4]                       # A's only epoch was dropped
            with pytest.raises(CapsuleMismatch, match=r"checkpoint\(name="):
                Session.open(path, device="cpu", runtime=RT)
        else:
            assert kept == [1, 3, 4]
            with Session.open(path, device="cpu", runtime=RT) as a:
                assert a.restored_epoch == 1 and a.tokens() == a_tokens


def test_identical_weights_in_another_folder_still_match(tmp_path, model_b):
    copy = tmp_path / "copy-of-b"
    shutil.copytree(model_b, copy)
    path = tmp_path / "s"
    with Session.open(path, model=model_b, tokenizer="cl100k_base", device="cpu", runtime=RT) as b:
        tokens = _turn(b, TEXT)
    with Session.open(path, model=copy, tokenizer="cl100k_base", device="cpu", runtime=RT) as b:
        assert b.restored_epoch == 1 and b.tokens() == tokens and b.restore_report == []


def test_a_layout_mismatch_names_the_settings(tmp_path):
    path = tmp_path / "s"
    two_epochs(path, TEXT, RT)
    with pytest.raises(CapsuleMismatch) as err:
        Session.open(path, device="cpu", runtime={"kv_pool_mb": 4, "max_context": 512})
    msg = str(err.value)
    assert "max_context=1024" in msg and "max_context=512" in msg
    assert "kv_pool_mb=8" in msg and "kv_pool_mb=4" in msg and "kv_blocks=" in msg
    assert "block_size" not in msg                    # only the settings that differ
    with pytest.raises(CapsuleMismatch, match="layout: capsule block_size=16, .* session block_size=32"):
        Session.open(path, device="cpu", runtime={**RT, "block_size": 32})
    with pytest.raises(CapsuleMismatch, match="dtype: capsule 'float32' != session 'bfloat16'"):
        Session.open(path, device="cpu", runtime={**RT, "dtype": "bfloat16"})


def test_a_manifest_from_before_labels_still_restores_and_mismatches_readably(tmp_path):
    path = tmp_path / "s"
    _, second = two_epochs(path, TEXT, RT)

    def unlabelled(m):
        m["binding"].pop("labels")
        return m
    old = forge(path, unlabelled, of=None)
    with Session.open(path, device="cpu", runtime=RT) as s:
        assert s.restored_epoch == old and s.tokens() == second and s.restore_report == []
    with pytest.raises(CapsuleMismatch, match="not recorded") as err:
        Session.open(path, device="cpu", runtime={**RT, "max_context": 512})
    assert "max_context=512" not in str(err.value)    # no settings to compare against: said so
