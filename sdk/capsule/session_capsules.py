"""Session methods for capsules: checkpoint (now, or deferred past a running LLM call), flush,
rollback, epochs; and the lock sections the other Session methods run in.

Locks: ``_lock`` guards the LLM, memory and store; ``_policy_lock`` guards act / reset. A capsule
is a consistent cut, so it takes both, always ``_lock`` first. A control loop must never wait
for a generate on another thread: ``checkpoint(wait=False, defer=True)`` returns None at once
when the LLM lock is busy, and the LLM call that holds it takes the capsule as it ends.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from . import assembly


class CapsuleMethods:
    _lock: threading.RLock
    _policy_lock: threading.RLock
    _llm_depth: int
    _deferred: tuple[str | None] | None
    _deferred_error: BaseException | None
    _closed: bool
    _ckpt: Any
    _store: Any
    _state: dict
    _llm_parts: Any
    _actor: Any

    def _check_open(self) -> None:   # provided by Session
        raise NotImplementedError

    def _restore(self, epoch_or_name: int | str | None) -> int | None:   # provided by Session
        raise NotImplementedError

    def checkpoint(self, *, wait: bool = True, name: str | None = None,
                   defer: bool = False) -> int | None:
        """Take a capsule of everything that decides the next output; returns its epoch.

        wait=True: durable when this returns. wait=False: only stages the dirty pages (host copies)
        and returns; a background writer makes it durable (see flush). A write failure is raised
        by the next checkpoint / flush / close. A capsule is taken between LLM calls, so it waits
        for a running one, unless defer=True (with wait=False): then, when an LLM call is
        running on another thread, it returns None at once and that call takes the capsule as
        it ends (what a control loop wants: it never waits for a generate).
        """
        self._check_open()
        self._raise_deferred_error()
        if defer:
            if wait:
                raise ValueError("defer=True needs wait=False: a deferred capsule is taken later")
            self._deferred = (name,)
            if not self._lock.acquire(blocking=False):
                return None   # the holder takes it (see _llm_section)
            try:
                self._deferred = None
                with self._policy_lock:
                    return self._capsule(False, name)
            finally:
                self._lock.release()
        with self._whole():
            self._check_open()
            self._deferred = None   # this capsule covers any deferred one
            return self._capsule(wait, name)

    def flush(self) -> None:
        """Block until every checkpoint(wait=False) so far is durable (a deferred one included)."""
        with self._llm_section():
            self._check_open()
            if self._deferred is not None:
                self._take_deferred()
            self._ckpt.flush()
        self._raise_deferred_error()

    def rollback(self, epoch_or_name: int | str) -> int:
        """Restore an epoch in place (same buffers, no re-capture); returns the epoch.

        The whole epoch is read and checked first: when it cannot be restored (CapsuleCorrupt naming
        the epoch and the field, CapsuleMismatch, UnknownEpoch) nothing of the session changes."""
        with self._whole():
            self._check_open()
            self._deferred = None   # a capsule asked for before the rollback is moot
            return self._restore(epoch_or_name)

    def epochs(self) -> list:
        """Committed epochs, oldest first (id, name, created, bytes_written, n_pages, meta)."""
        with self._llm_section():
            self._check_open()
            self._ckpt.flush()  # list what is durable, after the queued epochs and their retention
            return self._store.epochs()

    # -- internals ----------------------------------------------------------------------------
    def _capsule(self, wait: bool, name: str | None) -> int:
        host = assembly.host_state(self._llm_parts, self._state, self._actor)
        return self._ckpt.checkpoint(host, wait=wait, name=name)

    @contextlib.contextmanager
    def _whole(self) -> Iterator[None]:
        """Both locks, always in this order (act takes only the policy lock): a consistent cut."""
        with self._lock, self._policy_lock:
            yield

    @contextlib.contextmanager
    def _llm_section(self) -> Iterator[None]:
        """The LLM lock; on leaving the outermost section, take a capsule deferred meanwhile."""
        with self._lock:
            self._llm_depth += 1
            try:
                yield
            finally:
                self._llm_depth -= 1
                if self._llm_depth == 0 and self._deferred is not None:
                    self._take_deferred()
        # asked for between our check and our release: nobody else may be holding the lock now
        if self._deferred is not None and self._lock.acquire(blocking=False):
            try:
                if self._llm_depth == 0 and self._deferred is not None:
                    self._take_deferred()
            finally:
                self._lock.release()

    def _take_deferred(self) -> int | None:
        """Take the deferred capsule (holding _lock). Errors wait for the next checkpoint/flush:
        they must not surface in the unrelated LLM call that happened to hold the lock."""
        request, self._deferred = self._deferred, None
        if request is None or self._closed:
            return None
        try:
            with self._policy_lock:
                return self._capsule(False, request[0])
        except Exception as exc:
            self._deferred_error = exc
            return None

    def _raise_deferred_error(self) -> None:
        exc, self._deferred_error = self._deferred_error, None
        if exc is not None:
            raise exc
