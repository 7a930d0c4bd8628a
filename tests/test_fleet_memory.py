"""Fleet memory against a real S3 server on loopback: two robots see the union of their facts, one
fact per content, the publisher's K/V reused by the same model (bit-equal) and encoded by another;
a forget wins everywhere and for good; tampered or forged objects are refused, not obeyed."""
from __future__ import annotations

import pytest

from capsule import Session
from capsule.fleet import S3Bucket
from capsule.fleet.factwire import content_hash, encode_forget
from capsule.fleet.wire import Seal
from fleet_server import s3, s3_server  # noqa: F401 - fixtures

MEM = {"embedder": None}
KEY = b"fleet-memory-key-0123456789"


def _texts(s: Session) -> list[str]:
    return sorted(f.text for f in s.recall("cup charger tea kitchen hallway", 16))


def _open(path, **kw) -> Session:
    return Session.open(path, device="cpu", memory=MEM, **kw)


def test_two_robots_see_the_union_with_one_fact_per_content(tmp_path, s3):
    a, b = _open(tmp_path / "a"), _open(tmp_path / "b")
    try:
        a.remember("The red cup is fragile.", tags=["kitchen"])
        a.remember("The charger is in the hallway.")
        b.remember("The charger is in the hallway.")
        b.remember("Bob likes tea.")
        first = a.sync_memory(s3)
        second = b.sync_memory(s3)
        third = a.sync_memory(s3)
        assert (first.published, second.published, second.merged, third.merged) == (2, 1, 1, 1)
        assert second.reencoded == third.reencoded == 0
        want = ["Bob likes tea.", "The charger is in the hallway.", "The red cup is fragile."]
        assert _texts(a) == _texts(b) == want
        assert len([k for k, _ in S3Bucket(s3).keys("facts/")]) == 3
        # the same model reuses the publisher's K/V: the bytes are the publisher's
        fa = {f.text: f.id for f in a.recall("cup", 16)}
        fb = {f.text: f.id for f in b.recall("cup", 16)}
        cup = "The red cup is fragile."
        assert bytes(a.memory.store.fact_kv(fa[cup])) == bytes(b.memory.store.fact_kv(fb[cup]))
        assert b.memory.store.facts([fb[cup]])[0].tags == ("kitchen",)
        # and injecting it answers the same on both robots
        for s in (a, b):
            s.append("user: is the red cup fragile?\nrobot:")
        assert a.generate(8, memory_k=1) == b.generate(8, memory_k=1)
        again = a.sync_memory(s3)
        assert (again.published, again.merged, again.forgotten) == (0, 0, 0)
    finally:
        a.close()
        b.close()


def test_a_forget_wins_everywhere_and_for_good(tmp_path, s3, s3_server):
    a, b = _open(tmp_path / "a"), _open(tmp_path / "b")
    try:
        a.remember("The red cup is fragile.")
        a.remember("Bob likes tea.")
        a.sync_memory(s3)
        b.sync_memory(s3)
        b.forget(next(f.id for f in b.recall("red cup", 4) if f.text.startswith("The red cup")))
        assert b.sync_memory(s3).tombstoned == 1
        assert a.sync_memory(s3).forgotten == 1
        assert _texts(a) == _texts(b) == ["Bob likes tea."]
        # taught again in the same words: the fleet's forget still wins
        a.remember("The red cup is fragile.")
        got = a.sync_memory(s3)
        assert (got.published, got.forgotten) == (0, 1) and _texts(a) == ["Bob likes tea."]
        # a forget made offline (the server down) is published by the next sync
        tea = next(f.id for f in a.recall("tea", 4))
        s3_server.kill()
        a.forget(tea)
        s3_server.start()
        assert a.sync_memory(s3).tombstoned == 1
        assert b.sync_memory(s3).forgotten == 1 and _texts(b) == []
    finally:
        a.close()
        b.close()


def test_another_model_encodes_merged_facts_and_shares_its_kv(tmp_path, s3):
    a = _open(tmp_path / "a")
    c = Session.open(tmp_path / "c", model="builtin:small", device="cpu", memory=MEM)
    try:
        a.remember("The red cup is fragile.")
        a.sync_memory(s3)
        got = c.sync_memory(s3)
        assert (got.merged, got.reencoded) == (1, 1)
        assert c.sync_memory(s3).kv_shared == 1          # its K/V, for the next robot of its model
        d = Session.open(tmp_path / "d", model="builtin:small", device="cpu", memory=MEM)
        try:
            got = d.sync_memory(s3)
            assert (got.merged, got.reencoded) == (1, 0)
            kc = c.memory.store.fact_kv(c.recall("cup", 1)[0].id)
            kd = d.memory.store.fact_kv(d.recall("cup", 1)[0].id)
            assert bytes(kc) == bytes(kd)
        finally:
            d.close()
    finally:
        a.close()
        c.close()


def test_tampered_facts_and_forged_forgets_are_refused(tmp_path, s3):
    a, b = _open(tmp_path / "a"), _open(tmp_path / "b")
    try:
        a.remember("The red cup is fragile.")
        a.remember("Bob likes tea.")
        a.sync_memory(s3, sign_key=KEY)
        bucket = S3Bucket(s3)
        h = content_hash("The red cup is fragile.", ())
        data = bytearray(bucket.get(f"facts/{h}.fact", max_bytes=1 << 20))
        data[20] ^= 1
        bucket.delete(f"facts/{h}.fact")
        bucket.put(f"facts/{h}.fact", bytes(data))
        tea = content_hash("Bob likes tea.", ())
        bucket.put(f"forgets/{tea}.forget", encode_forget(tea, 0.0, "mallory", Seal(None)))   # no key
        got = b.sync_memory(s3, sign_key=KEY)
        assert got.merged == 1 and len(got.refused) == 2
        assert any("tag does not verify" in r for r in got.refused)
        assert _texts(b) == ["Bob likes tea."]            # not the tampered fact; the forged forget not obeyed
        assert a.sync_memory(s3, sign_key=KEY).forgotten == 0
        with pytest.raises(ValueError):
            b.sync_memory(s3, sign_key=b"short")
    finally:
        a.close()
        b.close()
