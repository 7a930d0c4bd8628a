"""Replication under faults, done for real: the S3 server SIGKILLed mid-upload and restarted, an
outage longer than the queue, the robot SIGKILLed mid-replication. Afterwards every remote epoch
verifies (no torn epoch is ever visible), the remote catches up, and the newest pulls equal to
the local store's."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from capsule import Session
from capsule.fleet import Replication, Replicator, S3Bucket, pull
from capsule.fleet.replica import Replica
from capsule.fleet.wire import Seal
from capsule.store import Store
from capsule.tools.s3_server import LoopbackS3
from fleet_server import BUCKET, use

PAGE = 1 << 20
RT = {"kv_pool_mb": 16, "max_context": 2048}


@pytest.fixture
def server(tmp_path, monkeypatch):
    srv = LoopbackS3(tmp_path / "weed")
    srv.start()
    use(srv, monkeypatch)
    try:
        yield srv
    finally:
        srv.stop()


def _pages(epoch: int, n: int) -> list[tuple[str, int, bytes]]:
    return [("big", (epoch * 7 + k) % 24, bytes([epoch % 251, k]) * (PAGE // 2)) for k in range(n)]


def _all_remote_epochs_verify(url: str, store: Store) -> list[int]:
    """Every remote epoch object verifies and its pages equal the local epoch's (where retained)."""
    replica = Replica(S3Bucket(url), Seal(None))
    ids = replica.epoch_ids()
    local = {e.id for e in store.epochs()}
    for epoch in ids:
        ep = replica.read_epoch(epoch, store.store_id)
        pages = replica.read_pages(ep)
        if epoch in local:
            app, want = store.load_epoch(epoch)
            assert ep.app == app
            assert {r: {i: bytes(p) for i, p in pp.items()} for r, pp in want.items()} == pages
    return ids


def test_server_killed_mid_upload_then_back_leaves_no_torn_epoch(tmp_path, server):
    url = f"s3://{BUCKET}/robot-kill"
    store = Store.open(tmp_path / "robot")
    rep = Replicator(store, Replication(url, max_bytes_per_s=16e6, retry_s=0.1, retry_max_s=0.5)).start()
    try:
        for epoch in range(1, 7):
            store.write_epoch(_pages(epoch, 6), f"manifest {epoch}".encode())
        time.sleep(0.6)                           # some epochs up, one half-way through its packs
        server.kill()
        down = rep.status
        time.sleep(0.5)
        assert rep.status.last_error is not None  # the outage is seen and retried, not fatal
        assert rep.status.failed is None
        for epoch in range(7, 9):                 # committing never waits for the remote
            began = time.monotonic()
            store.write_epoch(_pages(epoch, 3), f"manifest {epoch}".encode())
            assert time.monotonic() - began < 2.0
        server.start()
        assert rep.wait(60), rep.status
        assert rep.status.remote_epoch == 8 and rep.status.failed is None
        ids = _all_remote_epochs_verify(url, store)
        assert ids == list(range(1, 9)), (ids, down)
    finally:
        rep.close(5)
        store.close()


def test_an_outage_longer_than_the_queue_skips_the_oldest_and_catches_up(tmp_path, server, caplog):
    url = f"s3://{BUCKET}/robot-outage"
    with Session.open(tmp_path / "robot", device="cpu", runtime=RT,
                      replicate=Replication(url, max_queue=2, retry_s=0.1, retry_max_s=0.3, close_timeout_s=30)) as s:
        s.append("user: go to the kitchen\n")
        s.checkpoint()
        assert s.wait_replicated(30)
        server.kill()
        for _ in range(5):
            s.generate(2)
            s.checkpoint()
        time.sleep(0.5)
        assert s.replication.last_error and s.replication.remote_epoch == 1
        server.start()
        assert s.wait_replicated(60)
        st = s.replication
        want = s.tokens()
    assert st.remote_epoch == 6 and st.skipped == 3 and st.failed is None
    pull(url, tmp_path / "copy")
    with Session.open(tmp_path / "copy", device="cpu", runtime=RT) as s2:
        assert s2.tokens() == want


def test_close_waits_bounded_then_warns_and_push_sends_the_rest(tmp_path, server, caplog):
    url = f"s3://{BUCKET}/robot-close"
    s = Session.open(tmp_path / "robot", device="cpu", runtime=RT,
                     replicate=Replication(url, close_timeout_s=1.0, retry_s=0.1))
    s.append("user: hello\n")
    s.checkpoint()
    assert s.wait_replicated(30)
    server.kill()
    s.generate(3)
    s.checkpoint()
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="capsule"):
        s.close()
    assert time.monotonic() - began < 8
    assert "stopped behind" in caplog.text and "capsule push" in caplog.text
    server.start()
    from capsule.fleet import push
    assert push(tmp_path / "robot", url).uploaded == [2]


ROBOT = r"""
import sys, time
from capsule.fleet import Replication, Replicator
from capsule.store import Store
page = 1 << 20
store = Store.open(sys.argv[1])
rep = Replicator(store, Replication(sys.argv[2], max_bytes_per_s=8e6)).start()
for epoch in range(store.latest_epoch() or 0, 1000):
    e = epoch + 1
    store.write_epoch([("big", (e * 5 + k) % 16, bytes([e % 251, k]) * (page // 2)) for k in range(4)], b"m%d" % e)
    print("ACK", e, rep.status.remote_epoch, flush=True)
    time.sleep(0.05)
"""


def test_a_robot_killed_mid_replication_resumes_where_the_remote_stands(tmp_path, server):
    url = f"s3://{BUCKET}/robot-sigkill"
    child = subprocess.Popen([sys.executable, "-c", ROBOT, str(tmp_path / "robot"), url], stdout=subprocess.PIPE,
                             text=True, env=os.environ.copy())
    acked, remote = 0, 0
    try:
        for line in child.stdout:                 # whole lines only: the kill may cut the last one
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ACK":
                acked, remote = int(parts[1]), int(parts[2])
            if remote >= 2 and acked >= remote + 2:   # uploads behind commits: one is in flight
                break
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert acked >= 4
    store = Store.open(tmp_path / "robot")
    try:
        before = Replica(S3Bucket(url), Seal(None)).epoch_ids()
        assert before and before[-1] < store.latest_epoch()   # it died behind, with uploads pending
        rep = Replicator(store, Replication(url)).start()
        assert rep.wait(60), rep.status
        rep.close()
        ids = _all_remote_epochs_verify(url, store)
        assert ids[-1] == store.latest_epoch() >= acked
        assert ids == sorted(set(ids))
    finally:
        store.close()
