"""Background writer: makes staged epochs durable off the caller's thread, with group commit.

The caller hands over fully materialized pages (host bytes), so the live buffers may change
right after `submit` returns. When the disk is slower than the checkpoint rate, every epoch
waiting in the queue is appended and then made durable by one fsync + one index transaction.
A failure stops the writer: the failed batch is discarded from the store, epochs queued behind
it are dropped (they were deltas over what failed), and the error is raised by the next
submit / flush / close, naming every epoch that was not committed. Never swallowed.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Callable

from ..errors import StoreError

if TYPE_CHECKING:
    from ..store import Store


class BackgroundWriter:
    """One daemon thread per session. `submit` never blocks on I/O."""

    def __init__(self, store: "Store", on_durable: Callable[[list], None] | None = None):
        self._store = store
        self._on_durable = on_durable
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._error: StoreError | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="capsule-writer", daemon=True)
        self._thread.start()

    def submit(self, expected_epoch: int, pages: list, manifest: bytes, name: str | None, meta: dict,
               base: int | None) -> None:
        with self._cond:
            self._raise_pending()
            self._queue.append((expected_epoch, pages, manifest, name, meta, base))
            self._cond.notify_all()

    def flush(self) -> None:
        """Block until everything submitted is durable; raise the first write failure."""
        with self._cond:
            while (self._queue or self._busy) and self._error is None:
                self._cond.wait()
            self._raise_pending()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._error is not None) and not self._stop:
                    self._cond.wait()
                if self._stop and (not self._queue or self._error is not None):
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                for expected, pages, manifest, name, meta, base in batch:
                    got = self._store.stage_epoch(pages, manifest, name=name, meta=meta, base=base)
                    if got != expected:
                        raise StoreError(f"store assigned epoch {got}, session expected {expected}")
                infos = self._store.sync()            # one fsync + one transaction for the batch
            except BaseException as exc:  # kept and re-raised on the caller's next call
                self._fail(exc, [item[0] for item in batch])
                continue
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if self._on_durable and infos:
                try:
                    self._on_durable(infos)
                except Exception:  # maintenance after a commit must never kill the writer
                    pass

    def _fail(self, exc: BaseException, batch_ids: list[int]) -> None:
        try:
            self._store.discard_staged()
        except BaseException:
            pass  # the store poisons itself and cuts the bytes before its next write
        with self._cond:
            dropped = batch_ids + [item[0] for item in self._queue]
            self._queue.clear()
            self._error = StoreError(f"a background checkpoint failed; epochs {dropped} were not committed "
                                     f"(the next checkpoint is complete on its own): {exc}")
            self._error.__cause__ = exc
            self._cond.notify_all()
