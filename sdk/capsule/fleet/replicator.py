"""The background replicator: copies a Store's committed epochs to its replica, oldest first.

It never runs on the caller's thread and never blocks a checkpoint: a commit only sets an event
(Store.on_commit); the thread reads committed epochs through the Store's readers (which never wait
for the writer) and uploads them. It is resumable: at start, and after every outage, it asks the
remote what it holds (the newest epoch object there) and continues after it. The queue is bounded:
when more than max_queue committed epochs wait, the oldest of them are skipped (counted), so an
outage costs at most max_queue uploads to catch up and the newest epoch always goes.

Threading: start() and close() from the owner's thread; status and wait() from any.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from ..store import Collection, PageCorrupt, Store, StoreError, UnknownEpoch
from .bucket import ObjectStore, S3Bucket
from .config import Replication
from .errors import FleetError, RemoteUnavailable
from .records import RemoteRecords, list_remote, sync_records
from .replica import Replica
from .upload import Held, Throttle, attach, upload_epoch
from .wire import Seal

log = logging.getLogger("capsule")
POLL_S = 1.0    # a commit wakes the thread at once; this only catches commits nobody announced
WAIT_POLL_S = 0.01   # how often wait() looks at the status


@dataclass(frozen=True)
class ReplicationStatus:
    """A snapshot of the replicator. remote_epoch: the newest epoch the remote holds (0: none);
    failed: a fatal error (conflict, wrong key): replication stopped; last_error: the latest
    retried failure (outage), cleared by the next success."""
    url: str
    remote_epoch: int = 0
    uploaded: int = 0
    skipped: int = 0
    sent_bytes: int = 0
    last_error: str | None = None
    failed: str | None = None
    connected: bool = False
    last_upload_s: float = 0.0    # seconds the latest epoch took, from its pick-up to its epoch object


class Replicator:
    """Replicates `store` to `config.url` on a daemon thread; see the module docstring."""

    def __init__(self, store: Store, config: Replication, bucket: ObjectStore | None = None,
                 collections: tuple[Collection, ...] = ()):
        """collections: the keyed records to replicate with the epochs (a Session: its memory facts
        and their fleet links), so that a pulled store holds them under the same ids."""
        self.store, self.config = store, config
        self._bucket = bucket
        self._collections = collections
        self._records: RemoteRecords | None = None
        self._generation = -1           # the store's record_generation when records were last synced
        self._replica: Replica | None = None
        self._held = Held()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._throttle = Throttle(config.max_bytes_per_s, self._stop)
        self._lock = threading.Lock()
        self._status = ReplicationStatus(config.url)
        self._thread: threading.Thread | None = None
        self._unsubscribe = None

    # -- lifetime ------------------------------------------------------------------------------
    def start(self) -> "Replicator":
        if self._thread is not None:
            raise ValueError("this Replicator was started already")
        if self._bucket is None:     # no network yet; a missing boto3 is told here, not on the thread
            self._bucket = S3Bucket(self.config.url)
        self._unsubscribe = self.store.on_commit(lambda infos: self._wake.set())
        self._thread = threading.Thread(target=self._run, name=f"capsule-replicate {self.config.url}", daemon=True)
        self._thread.start()
        self._wake.set()
        return self

    @property
    def status(self) -> ReplicationStatus:
        with self._lock:
            return self._status

    def wait(self, timeout: float | None = None, epoch: int | None = None) -> bool:
        """Wait until the remote holds `epoch` (default: the newest committed now) or replication
        failed; True when it does. timeout None: no limit."""
        target = self.store.latest_epoch() if epoch is None else epoch
        if target is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status
            if st.remote_epoch >= target:
                return True
            if st.failed or self._thread is None or not self._thread.is_alive():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._wake.set()
            time.sleep(min(WAIT_POLL_S, left) if left is not None else WAIT_POLL_S)

    def close(self, timeout: float | None = None) -> bool:
        """Wait (at most timeout, default config.close_timeout_s) until what is committed is
        replicated, then stop the thread. Returns whether the remote caught up; warns if not."""
        if self._thread is None:
            return True
        timeout = self.config.close_timeout_s if timeout is None else timeout
        target = self._local_latest()
        caught_up = self.wait(timeout, target) if target else True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(5.0, timeout))
        if self._unsubscribe is not None:
            self._unsubscribe()
        st = self.status
        if not caught_up:
            why = st.failed or st.last_error or f"still uploading after {timeout:g} s"
            log.warning("replication to %s stopped behind: the remote holds epoch %d, the store %s (%s); the "
                        "rest goes when a replicator next runs on this store (or: capsule push %s %s)",
                        self.config.url, st.remote_epoch, target, why, self.store.path, self.config.url)
        return caught_up

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.config.retry_s
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._replica is None:
                    self._connect()
                self._catch_up()
                backoff = self.config.retry_s
            except RemoteUnavailable as exc:
                self._set(last_error=str(exc), connected=False)
                self._replica = None             # ask the remote what it holds after the outage
                self._stop.wait(backoff)
                backoff = min(self.config.retry_max_s, max(backoff * 2, 0.05))
                self._wake.set()
            except FleetError as exc:            # conflict, wrong key, a card that is not ours
                log.error("replication to %s stopped: %s", self.config.url, exc)
                self._set(failed=str(exc), connected=False)
                return
            except StoreError as exc:
                if self._stop.is_set():
                    return                      # the store was closed under us at shutdown
                log.error("replication to %s stopped: %s", self.config.url, exc)
                self._set(failed=str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug must not die silently on a daemon thread
                log.exception("replication to %s stopped by an unexpected error", self.config.url)
                self._set(failed=f"{type(exc).__name__}: {exc}")
                return

    def _connect(self) -> None:
        bucket = self._bucket
        assert bucket is not None
        replica = Replica(bucket, Seal(self.config.sign_key))
        held, _ = attach(replica, self.store)
        self._held, self._replica = held, replica
        self._records, self._generation = (list_remote(bucket) if self._collections else None), -1
        self._set(remote_epoch=held.epoch, connected=True, last_error=None)

    def _catch_up(self) -> None:
        assert self._replica is not None
        waiting = [e for e in self.store.epochs() if e.id > self._held.epoch]
        # skipped epochs are counted as gaps between uploads: past max_queue, dropped by local
        # retention before they went, or damaged here
        # records first: an epoch listed above was committed after every record it names
        generation = self.store.record_generation
        if self._records is not None and generation != self._generation:
            sent = sync_records(self.store, self._replica.bucket, self._replica.seal, self._collections, self._records)
            self._generation = generation
            self._add(skipped=0, sent=sent)
        if len(waiting) > self.config.max_queue:
            waiting = waiting[-self.config.max_queue:]
        for info in waiting:
            if self._stop.is_set():
                return
            began, before = time.monotonic(), self._held.epoch
            try:
                done = upload_epoch(self.store, self._replica, info, self._held, self._throttle)
            except (UnknownEpoch, PageCorrupt) as exc:   # dropped by retention meanwhile, or damaged here
                if isinstance(exc, PageCorrupt):
                    log.warning("replication to %s skips epoch %d: %s", self.config.url, info.id, exc)
                continue
            if before:
                self._add(skipped=done.epoch - before - 1)
            with self._lock:
                st = self._status
                self._status = replace(st, remote_epoch=done.epoch, uploaded=st.uploaded + (not done.already),
                                       sent_bytes=st.sent_bytes + done.sent_bytes, last_error=None,
                                       last_upload_s=time.monotonic() - began)

    # -- helpers -------------------------------------------------------------------------------
    def _local_latest(self) -> int | None:
        try:
            return self.store.latest_epoch()
        except StoreError:
            return None

    def _set(self, **changes: object) -> None:
        with self._lock:
            self._status = replace(self._status, **changes)  # type: ignore[arg-type]

    def _add(self, skipped: int, sent: int = 0) -> None:
        with self._lock:
            st = self._status
            self._status = replace(st, skipped=st.skipped + skipped, sent_bytes=st.sent_bytes + sent)
