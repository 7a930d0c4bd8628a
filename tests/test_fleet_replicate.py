"""Replication to a real S3 server on loopback (SeaweedFS): epochs replicated in the background and
pulled into a fresh store elsewhere continue exactly in a fresh process; deltas send only new pages;
flipped remote bytes, wrong keys and foreign stores are refused with typed errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capsule import CapsuleMismatch, Session
from capsule.fleet import (FleetConflict, FleetError, FleetKeyError, RemoteCorrupt, S3Bucket, pull, push,
                           remote_epochs)
from capsule.fleet.replica import epoch_key
from capsule.store import Store
from fleet_server import s3, s3_server  # noqa: F401 - fixtures

RT = {"kv_pool_mb": 16, "max_context": 2048}
KEY = b"fleet-key-0123456789abcdef"
TALK = "".join(f"user: step {i}: move the red cup {i * 7} cm left.\nrobot: ok.\n" for i in range(20))

CHILD = r"""
import json, sys
from capsule import Session
a = json.loads(sys.argv[1])
with Session.open(a["store"], device="cpu", runtime=a["rt"]) as s:
    out = {"restored": s.restored_epoch, "state": s.state}
    s.generate(a["m"], stream=a["streams"], temperature=a["t"], top_p=0.95)
    out["tokens"] = {n: s.tokens(n) for n in a["streams"]}
print(json.dumps(out))
"""


def _child(**args) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _flip(url: str, key: str, at: int = -40) -> None:
    bucket = S3Bucket(url)
    data = bytearray(bucket.get(key, max_bytes=1 << 30))
    data[at] ^= 0x10
    bucket.delete(key)
    assert bucket.put(key, bytes(data), if_absent=True)


@pytest.mark.parametrize("streams,temperature", [(["main"], 0.0), (["a", "b"], 0.9)])
def test_replicated_epochs_pulled_elsewhere_continue_exactly(tmp_path, s3, streams, temperature):
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT, replicate={"url": s3, "sign_key": KEY}) as s:
        for i, name in enumerate(streams):
            s.append(TALK[i * 50:], stream=name)
        seed = 11 if temperature else None
        s.generate(4, stream=streams, temperature=temperature, top_p=0.95, seed=seed)
        s.checkpoint(name="before-grasp")
        named = {n: s.tokens(n) for n in streams}
        s.generate(6, stream=streams, temperature=temperature, top_p=0.95)
        named_tail = {n: s.tokens(n) for n in streams}
        s.rollback("before-grasp")
        for step in range(3):
            s.generate(3, stream=streams, temperature=temperature, top_p=0.95)
            s.state = {"step": step}
            last = s.checkpoint(wait=step % 2 == 0)
        s.generate(7, stream=streams, temperature=temperature, top_p=0.95)
        want = {n: s.tokens(n) for n in streams}
    assert s.replication.remote_epoch == last and s.replication.failed is None
    _, listed = remote_epochs(s3, sign_key=KEY)
    assert [e.epoch for e in listed] == [1, 2, 3, 4]

    got = pull(s3, tmp_path / "other", sign_key=KEY)
    assert (got.epoch, got.local_epoch) == (last, 1)
    child = _child(store=str(tmp_path / "other"), rt=RT, streams=streams, m=7, t=temperature)
    assert child["restored"] == 1 and child["state"] == {"step": 2}
    assert child["tokens"] == want

    pull(s3, tmp_path / "named", epoch="before-grasp", sign_key=KEY)
    with Session.open(tmp_path / "named", device="cpu", runtime=RT) as s2:
        assert {n: s2.tokens(n) for n in streams} == named
        s2.generate(6, stream=streams, temperature=temperature, top_p=0.95)
        assert {n: s2.tokens(n) for n in streams} == named_tail


def test_a_delta_sends_only_the_new_pages(tmp_path, s3):
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT, replicate=s3) as s:
        s.append(TALK * 4)
        e1 = s.checkpoint()
        assert s.wait_replicated(30)
        first = s.replication.sent_bytes
        s.append("user: and the blue one?\n")
        e2 = s.checkpoint()
        assert s.wait_replicated(30)
        second = s.replication.sent_bytes - first
        view = s.store.view(e2)
        written = [(r, i) for r, pages in view.items() for i, e in pages.items() if e == e2]
        _, new_pages = s.store.load_epoch(e2, only=written)
        _, all_pages = s.store.load_epoch(e1)
    objects = dict(S3Bucket(s3).keys("epochs/"))          # each epoch also sends its epoch object
    o1, o2 = objects[epoch_key(e1)], objects[epoch_key(e2)]
    assert first - o1 == sum(len(p) for pp in all_pages.values() for p in pp.values())  # the first went whole
    assert second - o2 == sum(len(p) for pp in new_pages.values() for p in pp.values())  # then only what e2 wrote
    assert 0 < second < first


def test_flipped_remote_bytes_are_refused_on_pull(tmp_path, s3):
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT, replicate=s3) as s:
        s.append(TALK)
        s.checkpoint()
        s.generate(3)
        s.checkpoint()
    _flip(s3, epoch_key(2))
    with pytest.raises(RemoteCorrupt, match="epochs/0+2.epoch"):
        pull(s3, tmp_path / "a")
    assert not (tmp_path / "a").exists()          # nothing was created from it
    pull(s3, tmp_path / "b", epoch=1)             # an intact older epoch still comes
    store_id, listed = remote_epochs(s3)
    assert isinstance(listed[1], RemoteCorrupt) and listed[0].epoch == 1

    bucket = S3Bucket(s3)
    pack = next(k for k, _ in bucket.keys("packs/"))
    _flip(s3, pack, at=5)
    with pytest.raises(RemoteCorrupt, match="does not match its SHA-256"):
        pull(s3, tmp_path / "c", epoch=1)


def test_fleet_keys_are_checked_before_anything_is_read(tmp_path, s3):
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT, replicate={"url": s3, "sign_key": KEY}) as s:
        s.append(TALK)
        s.checkpoint()
    with pytest.raises(FleetKeyError, match="signed with a fleet key"):
        pull(s3, tmp_path / "a")
    with pytest.raises(FleetKeyError, match="another fleet key"):
        pull(s3, tmp_path / "a", sign_key=b"x" * 32)
    assert not (tmp_path / "a").exists()
    pull(s3, tmp_path / "a", sign_key=KEY)


def test_a_prefix_belongs_to_one_store(tmp_path, s3):
    with Session.open(tmp_path / "one", device="cpu", runtime=RT, replicate=s3) as s:
        s.append(TALK)
        s.checkpoint()
    with Session.open(tmp_path / "two", device="cpu", runtime=RT, replicate={"url": s3, "close_timeout_s": 2}) as s:
        s.append("something else\n")
        s.checkpoint()                            # the local store commits whatever the remote says
        assert s.wait_replicated(10) is False
        assert "replicates store" in s.replication.failed
    with pytest.raises(FleetConflict, match="already holds epochs"):
        pull(s3, tmp_path / "two")                # a pull never writes into a store that has epochs


def test_a_pulled_capsule_is_bound_to_its_model(tmp_path, s3):
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT, replicate=s3) as s:
        s.append(TALK)
        s.checkpoint()
    pull(s3, tmp_path / "other")
    with pytest.raises(CapsuleMismatch):
        Session.open(tmp_path / "other", model="builtin:small", device="cpu", runtime=RT)


def test_push_then_pull_of_a_store_that_never_replicated(tmp_path, s3):
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT) as s:
        s.append(TALK)
        for _ in range(3):
            s.generate(2)
            s.checkpoint()
        want = s.tokens()
    done = push(tmp_path / "robot", s3)
    assert done.uploaded == [1, 2, 3] and done.already == 0
    assert push(tmp_path / "robot", s3).uploaded == []          # idempotent
    pull(s3, tmp_path / "copy")
    with Session.open(tmp_path / "copy", device="cpu", runtime=RT) as s2:
        assert s2.tokens() == want
    with pytest.raises(FleetError, match="no replica"):
        pull(s3 + "-nothing", tmp_path / "none")


def test_the_cli_pushes_lists_and_pulls(tmp_path, s3, capsys):
    from capsule.cli import main

    with Session.open(tmp_path / "robot", device="cpu", runtime=RT) as s:
        s.append(TALK)
        s.checkpoint(name="home")
    assert main(["push", str(tmp_path / "robot"), s3]) == 0
    assert "pushed 1 epoch(s)" in capsys.readouterr().out
    assert main(["inspect", s3]) == 0
    out = capsys.readouterr().out
    assert "1 epoch(s)" in out and "home" in out
    assert main(["pull", s3, str(tmp_path / "copy"), "--epoch", "home"]) == 0
    assert "pulled epoch 1" in capsys.readouterr().out
    with Store.open(tmp_path / "copy", create=False) as st:
        assert st.epochs()[0].meta["fleet"]["epoch"] == 1
    assert main(["pull", s3, str(tmp_path / "copy")]) == 1
    assert "already holds epochs" in capsys.readouterr().err


def test_memory_facts_travel_with_their_ids_and_injected_capsules_continue_exactly(tmp_path, s3):
    mem = {"embedder": None}
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT, memory=mem, replicate=s3) as s:
        gone = s.remember("The blue box is empty.")
        s.remember("The red cup is fragile.", tags=["kitchen"])
        s.remember("The charger is in the hallway.")
        s.forget(gone)
        s.append("user: where is the charger? is the red cup fragile?\nrobot:")
        s.generate(4, memory_k=2)
        region = list(s.engine.streams["main"].region.fact_ids)
        assert len(region) == 2
        s.checkpoint()
        s.generate(12)
        want = s.tokens()
        facts = {f.id: f.text for f in s.recall("charger cup box", 8)}
    got = pull(s3, tmp_path / "other")
    assert got.records == 2
    child = _child_mem(tmp_path / "other")
    assert child["region"] == region                    # the injected facts are still there, same ids
    assert child["tokens"] == want
    assert {int(k): v for k, v in child["facts"].items()} == facts
    with pytest.raises(FleetConflict):
        pull(s3, tmp_path / "other")


CHILD_MEM = r"""
import json, sys
from capsule import Session
with Session.open(sys.argv[1], device="cpu", runtime=json.loads(sys.argv[2]), memory={"embedder": None}) as s:
    region = list(s.engine.streams["main"].region.fact_ids)
    s.generate(12)
    print(json.dumps({"region": region, "tokens": s.tokens(), "facts": {f.id: f.text for f in s.recall("charger cup box", 8)}}))
"""


def _child_mem(store) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD_MEM, str(store), json.dumps(RT)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_an_epoch_from_another_store_is_refused_even_under_the_same_key(tmp_path, s3):
    for name in ("a", "b"):
        with Session.open(tmp_path / name, device="cpu", runtime=RT,
                          replicate={"url": f"{s3}-{name}", "sign_key": KEY}) as s:
            s.append(TALK if name == "a" else "another robot's day\n")
            s.checkpoint()
    theirs = S3Bucket(f"{s3}-a").get(epoch_key(1), max_bytes=1 << 26)
    mine = S3Bucket(f"{s3}-b")
    mine.delete(epoch_key(1))
    assert mine.put(epoch_key(1), theirs, if_absent=True)     # robot a's signed epoch, planted in b's replica
    with pytest.raises(RemoteCorrupt, match="belongs to store"):
        pull(f"{s3}-b", tmp_path / "c", sign_key=KEY)
