"""The replica's objects as bytes: remote epochs round-trip; any flipped, cut or foreign byte is refused
before anything is used; bounds hold on hostile objects; the store card; URL and config checks."""
from __future__ import annotations

import os
import random
import struct

import pytest

from capsule import CapsuleError
from capsule.fleet import RemoteCorrupt, Replication, parse_url
from capsule.fleet.wire import (ENTRY, MAGIC, TAG_BYTES, PageAt, RemoteEpoch, Seal, StoreCard, decode_card,
                                decode_epoch, encode_card, encode_epoch, sha256)

KEY = b"k" * 32


def _epoch(signed: bool = True) -> RemoteEpoch:
    pages = {"kv": {i: PageAt(1 + i % 3, f"packs/{i % 2}.pack", 100 * i, 100, sha256(bytes([i]) * 100))
                    for i in range(6)},
             "input_ids": {0: PageAt(3, "packs/1.pack", 700, 4096, sha256(b"x" * 4096))}}
    return RemoteEpoch("store-a", 3, 2, "before-grasp", 1.7e9, {"streams": {"main": 40}}, signed, pages,
                       b'{"host": 1}', (("packs/0.pack", 600), ("packs/1.pack", 4796)))


@pytest.mark.parametrize("key", [KEY, None])
def test_a_remote_epoch_round_trips(key):
    ep = _epoch(key is not None)
    got = decode_epoch(encode_epoch(ep, Seal(key)), Seal(key), "x")
    assert (got.store_id, got.epoch, got.base, got.name, got.created, got.meta, got.app, got.signed) == \
           (ep.store_id, ep.epoch, ep.base, ep.name, ep.created, ep.meta, ep.app, ep.signed)
    assert got.view == ep.view and set(got.packs) == set(ep.packs)
    assert got.n_pages() == 7 and got.page_bytes() == 600 + 4096


@pytest.mark.parametrize("key", [KEY, None])
def test_every_flipped_or_cut_byte_is_refused(key):
    data = encode_epoch(_epoch(key is not None), Seal(key))
    rng = random.Random(7)
    for pos in list(range(0, len(data), max(1, len(data) // 300))) + [len(data) - 1]:
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(RemoteCorrupt):
            decode_epoch(bytes(bad), Seal(key), "x")
    for cut in (0, 1, 12, len(data) // 2, len(data) - 1):
        with pytest.raises(RemoteCorrupt):
            decode_epoch(data[:cut], Seal(key), "x")


def test_keys_are_not_interchangeable():
    signed = encode_epoch(_epoch(True), Seal(KEY))
    with pytest.raises(RemoteCorrupt, match="fleet key"):
        decode_epoch(signed, Seal(b"o" * 32), "x")          # another fleet's key
    with pytest.raises(RemoteCorrupt):
        decode_epoch(signed, Seal(None), "x")                # read without the key
    unsigned = encode_epoch(_epoch(False), Seal(None))
    with pytest.raises(RemoteCorrupt):
        decode_epoch(unsigned, Seal(KEY), "x")               # a SHA-256 tag where an HMAC is due
    # rewritten by someone without the key: valid SHA-256 framing, "signed": true in the head
    forged = encode_epoch(_epoch(True), Seal(None))
    with pytest.raises(RemoteCorrupt):
        decode_epoch(forged, Seal(KEY), "x")


def _sealed(head: bytes, rest: bytes, key=KEY) -> bytes:
    body = struct.pack("<8sI", MAGIC, len(head)) + head + rest
    return body + Seal(key).tag(body)


@pytest.mark.parametrize("head,rest", [
    (b'{"store":"s","epoch":1,"base":0,"name":null,"created":1,"meta":{},"signed":true,"packs":[["p",10]],'
     b'"regions":[["kv",100000000]],"app_bytes":0}', ENTRY.pack(0, 1, 0, 0, 10, b"\0" * 32)),  # huge count
    (b'{"store":"s","epoch":1,"base":0,"name":null,"created":1,"meta":{},"signed":true,"packs":[["p",10]],'
     b'"regions":[["kv",1]],"app_bytes":0}', ENTRY.pack(0, 1, 0, 5, 10, b"\0" * 32)),          # past its pack
    (b'{"store":"s","epoch":1,"base":0,"name":null,"created":1,"meta":{},"signed":true,"packs":[["p",10]],'
     b'"regions":[["kv",1]],"app_bytes":0}', ENTRY.pack(0, 9, 0, 0, 10, b"\0" * 32)),          # newer writer
    (b'{"store":"s","epoch":1,"base":0,"name":null,"created":1,"meta":{},"signed":true,"packs":[["p",10]],'
     b'"regions":[["kv",1]],"app_bytes":0}', ENTRY.pack(0, 1, 3, 0, 10, b"\0" * 32)),          # no pack 3
    (b'{"store":"s","epoch":1,"base":0,"name":null,"created":1,"meta":{},"signed":true,"packs":[["p",20]],'
     b'"regions":[["kv",2]],"app_bytes":0}', ENTRY.pack(1, 1, 0, 0, 1, b"\0" * 32) * 2),      # not increasing
    (b'{"store":"s","epoch":1,"base":0,"name":null,"created":1,"meta":{},"signed":true,"packs":[],'
     b'"regions":[],"app_bytes":99}', b"short"),                                                  # app length
    (b'[' * 50 + b']' * 50, b""),                                                                  # deep, not an object
    (b'{"store":"s","epoch":NaN}', b""),
])
def test_a_hostile_object_with_a_valid_tag_is_refused_unallocated(head, rest):
    # a holder of the key is not trusted with our memory either: bounds are checked before use
    with pytest.raises(RemoteCorrupt):
        decode_epoch(_sealed(head, rest), Seal(KEY), "x")


def test_an_object_over_the_size_bound_is_refused_unread():
    with pytest.raises(RemoteCorrupt, match="size"):
        decode_epoch(b"\0" * (64 << 20) + b"\0" * (TAG_BYTES + 1), Seal(KEY), "x")


def test_the_store_card_round_trips_and_refuses_junk():
    card = StoreCard("abc", True, Seal(KEY).key_check("abc"), 1.5)
    assert decode_card(encode_card(card), "x") == card
    for junk in (b"", b"{}", b'{"format":"capsule-fleet/1"}', b"\xff" * 10, b'{"format":"capsule-fleet/1",'
                 b'"store":1,"signed":true,"key_check":"","created":0}'):
        with pytest.raises(RemoteCorrupt):
            decode_card(junk, "x")


def test_urls_and_settings_are_checked_with_a_message():
    assert parse_url("s3://fleet/robot-7/").prefix == "robot-7"
    assert parse_url("s3://fleet").prefix == ""
    for bad in ("fleet/robot", "s3://", "s3://a/x", "s3://fleet/../x", "s3://fleet/a//b", "s3://fl_eet/x"):
        with pytest.raises(ValueError):
            parse_url(bad)
    with pytest.raises(ValueError, match="16"):
        Replication("s3://fleet/r", sign_key=b"short")
    with pytest.raises(ValueError, match="max_queue"):
        Replication("s3://fleet/r", max_queue=0)
    with pytest.raises(ValueError, match="unknown field"):
        Replication.of({"url": "s3://fleet/r", "max_qeue": 3})
    assert "k" * 16 not in repr(Replication("s3://fleet/r", sign_key=b"k" * 16))   # a key is never printed
    assert issubclass(RemoteCorrupt, CapsuleError)
    with pytest.raises(ValueError, match="at least 16"):
        Seal(os.urandom(8))
