"""Part 3 of `capsule bench --suite fleet`: an S3 outage while the robot keeps committing.

The main thread commits at a fixed cadence (generate(NEW_TOKENS) + checkpoint(wait=True): durable
when it returns), timing every checkpoint; a driver thread SIGKILLs the server, waits out the
outage, starts it again on the same folder and polls the replicator. Checkpoint latency is split
into before / during / after the outage: it must not grow, as a commit never waits for the
remote. Catch-up is timed from the server answering again: to the epoch that was newest at that
moment (the backlog), and to the newest one at all (live again while commits go on).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ...fleet import Replication, ReplicationStatus, S3Bucket
from ...fleet.replica import Replica
from ...fleet.wire import Seal
from ...session import Session
from ..s3_server import LoopbackS3
from .fleet_throughput import wait_remote
from .timing import percentile

NEW_TOKENS = 4
POLL_S = 0.01


class Driver(threading.Thread):
    """kill -> outage_s -> start, then poll the replicator until the remote is live again."""

    def __init__(self, server: LoopbackS3, status: Callable[[], ReplicationStatus], pre_s: float,
                 outage_s: float, timeout_s: float):
        super().__init__(name="capsule-bench-outage", daemon=True)
        self.server, self.status = server, status
        self.pre_s, self.outage_s, self.timeout_s = pre_s, outage_s, timeout_s
        self.newest = 0                      # the main thread's latest committed epoch
        self.t: dict[str, float] = {}
        self.seen: dict[str, Any] = {}
        self.done, self.cancel = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            self.error = exc
        finally:
            self.done.set()

    def _run(self) -> None:
        if self.cancel.wait(self.pre_s):
            return
        ports = dict(self.server.ports)
        st = self.status()
        self.seen["remote_at_kill"], self.seen["skipped_at_kill"] = st.remote_epoch, st.skipped
        self.t["kill"] = time.perf_counter()
        self.server.kill()
        if self.cancel.wait(self.outage_s):     # interrupted: the owner stops the server, never restart it
            return
        st = self.status()
        self.seen.update(error_during_outage=st.last_error, connected_at_restart=st.connected,
                         remote_at_restart=st.remote_epoch)
        self.t["start"] = time.perf_counter()
        self.seen["boot_s"] = self.server.start()
        self.t["ready"] = time.perf_counter()
        if self.server.ports != ports:   # the replicator's client still dials the old endpoint
            raise RuntimeError(f"the restarted S3 server moved to other ports ({ports} -> {self.server.ports})")
        self.seen["backlog_target"] = target = self.newest
        end = self.t["ready"] + self.timeout_s
        while time.perf_counter() < end and not self.cancel.is_set():
            st, now = self.status(), time.perf_counter()
            if st.connected and "connected" not in self.t:
                self.t["connected"] = now
            elif not st.connected and st.last_error not in (None, self.seen["error_during_outage"]):
                self.seen.setdefault("error_after_restart", st.last_error)   # a retry failed on the live server
            if st.remote_epoch >= target and "backlog" not in self.t:
                self.t["backlog"] = now
            if "backlog" in self.t and st.remote_epoch >= self.newest:
                self.t["live"] = now
                break
            self.cancel.wait(POLL_S)


def _phase(lat: list[float]) -> dict[str, Any]:
    if not lat:
        return {"checkpoints": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"checkpoints": len(lat), "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
            "max_ms": max(lat) * 1e3}


def outage(s: Session, config: Replication, server: LoopbackS3, *, pre_s: float, outage_s: float, post_s: float,
           period_s: float, timeout_s: float) -> dict[str, Any]:
    """Commit every period_s through an outage of outage_s; s replicates with `config`. See the module
    docstring."""
    drv = Driver(server, lambda: s.replication, pre_s, outage_s, timeout_s)
    commits: list[tuple[float, float, int]] = []     # (start, seconds, epoch)
    t0, k = time.perf_counter(), 0
    drv.start()
    try:
        while not drv.done.is_set() or time.perf_counter() < drv.t.get("live", drv.t.get("ready", 0.0)) + post_s:
            time.sleep(max(0.0, t0 + k * period_s - time.perf_counter()))
            s.generate(NEW_TOKENS)
            a = time.perf_counter()
            epoch = s.checkpoint()
            commits.append((a, time.perf_counter() - a, epoch))
            drv.newest = epoch
            k = max(k + 1, int((time.perf_counter() - t0) / period_s) + 1)   # late: keep the grid
    finally:                                    # Ctrl-C too: no server start after the owner stopped it
        drv.cancel.set()
        drv.join()
    if drv.error is not None:
        raise drv.error
    settled = wait_remote(s, timeout_s)         # the post-outage commits too, before counting what is there
    t, seen, st = drv.t, drv.seen, s.replication
    during = [c for c in commits if t["kill"] <= c[0] < t["ready"]]
    # the server may answer (and the replicator reconnect) while start() still probes it, so only
    # the commits before start() was called surely waited for the reconnect, where max_queue bounds them
    down = [c for c in commits if t["kill"] <= c[0] < t["start"]]
    remote = set(Replica(S3Bucket(config.url), Seal(config.sign_key)).epoch_ids())
    after_kill = [c[2] for c in commits if c[2] > seen["remote_at_kill"]]
    missing = [e for e in after_kill if e not in remote]
    ready = t["ready"]
    return {
        "outage_s": t["start"] - t["kill"], "server_boot_s": seen["boot_s"],
        "epochs_committed_during_outage": len(during), "epochs_committed_while_down": len(down),
        "epochs_committed": len(commits),
        "commit_period_s": period_s, "max_queue": config.max_queue,
        "retry_s": config.retry_s, "retry_max_s": config.retry_max_s,
        "outage_noticed": seen["error_during_outage"] is not None and not seen["connected_at_restart"],
        "last_error_during_outage": seen["error_during_outage"], "error_after_restart": seen.get("error_after_restart"),
        "remote_epoch_at_kill": seen["remote_at_kill"], "remote_epoch_at_restart": seen["remote_at_restart"],
        "backlog_target_epoch": seen["backlog_target"],
        "reconnect_s": t["connected"] - ready if "connected" in t else None,
        "catch_up_s": t["backlog"] - ready if "backlog" in t else None,
        "live_s": t["live"] - ready if "live" in t else None,
        "caught_up": "live" in t and settled, "remote_epoch": st.remote_epoch, "newest_epoch": commits[-1][2],
        "skipped": st.skipped - seen["skipped_at_kill"], "not_on_remote": len(missing),
        "checkpoint_before": _phase([c[1] for c in commits if c[0] < t["kill"]]),
        "checkpoint_during": _phase([c[1] for c in during]),
        "checkpoint_after": _phase([c[1] for c in commits if c[0] >= ready])}
