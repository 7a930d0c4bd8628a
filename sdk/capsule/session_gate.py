"""CapsuleGate: the Session's two locks and its capsules (checkpoint now or deferred past a
running LLM call, flush, rollback, epochs, close).

Locks: `llm_section()` guards the LLM, memory and store; `policy_lock` guards act / reset. A
capsule is a consistent cut, so it takes both, always the LLM lock first (`whole()`). A control
loop must never wait for a generate on another thread: `checkpoint(wait=False, defer=True)`
returns None at once when the LLM lock is busy, and the LLM call holding it takes the capsule
as it leaves its outermost section.

The gate knows nothing of what a capsule holds: `capture` builds the host state (called under
both locks) and `restore` installs an epoch (called under both locks; None = the newest).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from .state.checkpointer import Checkpointer, HostState
from .store import Store
from .store.info import EpochInfo


class CapsuleGate:
    """Thread-safe: every public method takes the locks it needs."""

    def __init__(self, checkpointer: Checkpointer, store: Store, capture: Callable[[], HostState],
                 restore: Callable[[int | str | None], int | None]):
        self.checkpointer = checkpointer
        self.store = store
        self._capture = capture
        self._restore = restore
        self._lock = threading.RLock()          # LLM, memory, store
        self.policy_lock = threading.RLock()    # act / reset: a control loop never waits on an LLM call
        self._depth = 0                         # nesting of llm_section on the holding thread
        self._deferred: tuple[str | None] | None = None   # a capsule asked for while the LLM was busy
        self._deferred_error: BaseException | None = None
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ValueError("this Session is closed; open a new one")

    # -- capsules -----------------------------------------------------------------------------
    def checkpoint(self, wait: bool, name: str | None, defer: bool) -> int | None:
        """See Session.checkpoint."""
        self.check_open()
        self._raise_deferred_error()
        if defer:
            if wait:
                raise ValueError("defer=True needs wait=False: a deferred capsule is taken later")
            self._deferred = (name,)
            if not self._lock.acquire(blocking=False):
                return None   # the holder takes it (see llm_section)
            try:
                self._deferred = None
                with self.policy_lock:
                    return self._take(False, name)
            finally:
                self._lock.release()
        with self.whole():
            self.check_open()
            self._deferred = None   # this capsule covers any deferred one
            return self._take(wait, name)

    def flush(self) -> None:
        """Block until every background capsule so far is durable (a deferred one included)."""
        with self.llm_section():
            self.check_open()
            if self._deferred is not None:
                self._take_deferred()
            self.checkpointer.flush()
        self._raise_deferred_error()

    def rollback(self, epoch_or_name: int | str) -> int | None:
        with self.whole():
            self.check_open()
            self._deferred = None   # a capsule asked for before the rollback is moot
            return self._restore(epoch_or_name)

    def restore_newest(self) -> int | None:
        with self.whole():
            return self._restore(None)

    def epochs(self) -> list[EpochInfo]:
        with self.llm_section():
            self.check_open()
            self.checkpointer.flush()  # list what is durable, after the queued epochs and their retention
            return self.store.epochs()

    def close(self, last_commit: Callable[[], object] | None = None) -> bool:
        """Wait for pending capsules, call last_commit() (nothing commits after it: e.g. let a
        replicator catch up), then close the store; False if it was closed already."""
        with self.whole():
            if self.closed:
                return False
            self.closed = True
            try:
                self.checkpointer.close()
            finally:
                try:
                    if last_commit is not None:
                        last_commit()
                finally:
                    self.store.close()
            return True

    # -- lock sections --------------------------------------------------------------------------
    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Both locks, always in this order (act takes only the policy lock): a consistent cut."""
        with self._lock, self.policy_lock:
            yield

    @contextlib.contextmanager
    def llm_section(self) -> Iterator[None]:
        """The LLM lock; on leaving the outermost section, take a capsule deferred meanwhile."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._deferred is not None:
                    self._take_deferred()
        # asked for between our check and our release: nobody else may be holding the lock now
        if self._deferred is not None and self._lock.acquire(blocking=False):
            try:
                if self._depth == 0 and self._deferred is not None:
                    self._take_deferred()
            finally:
                self._lock.release()

    # -- internals ------------------------------------------------------------------------------
    def _take(self, wait: bool, name: str | None) -> int:
        return self.checkpointer.checkpoint(self._capture(), wait=wait, name=name)

    def _take_deferred(self) -> int | None:
        """Take the deferred capsule (holding the LLM lock). Errors wait for the next checkpoint /
        flush: they must not surface in the unrelated LLM call that happened to hold the lock."""
        request, self._deferred = self._deferred, None
        if request is None or self.closed:
            return None
        try:
            with self.policy_lock:
                return self._take(False, request[0])
        except Exception as exc:
            self._deferred_error = exc
            return None

    def _raise_deferred_error(self) -> None:
        exc, self._deferred_error = self._deferred_error, None
        if exc is not None:
            raise exc
