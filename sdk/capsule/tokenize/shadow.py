"""Shadow verifier: re-encodes a sample of incremental results in full, off the caller's thread.

One daemon worker per verifier, started on the first sampled job and gone after a few idle
seconds. A mismatch logs a reproducer on the "capsule" logger and calls ``on_mismatch`` (the
incremental tokenizer then re-encodes fully from its next call on). Submitting never blocks:
when too many checks are pending, the new one is dropped and counted.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import random
import threading
from typing import Any, Callable, Sequence

log = logging.getLogger("capsule")

MAX_PENDING = 4
IDLE_EXIT_S = 5.0


class ShadowVerifier:
    """Samples jobs with its own seeded RNG and checks them against ``reference.encode``."""

    def __init__(self, reference: Any, family: str, rate: float, seed: int | None,
                 on_mismatch: Callable[[], None]) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"shadow_rate must be a number in [0, 1], not {rate!r}")
        if not callable(getattr(reference, "encode", None)):
            raise ValueError("shadow_reference must have an encode(text) method")
        self._ref, self._family, self.rate = reference, family, float(rate)
        self._rng = random.Random(seed)
        self._on_mismatch = on_mismatch
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self.sampled = self.checks = self.mismatches = self.dropped = self.errors = 0

    def sample(self) -> bool:
        """Draw once: True for the share ``rate`` of calls (deterministic for a seed)."""
        return self.rate > 0 and self._rng.random() < self.rate

    def submit(self, text_parts: Sequence[str], id_parts: Sequence[Sequence[int]],
               seam: int) -> None:
        """Queue one check of ids == reference(text); parts are immutable snapshots."""
        with self._cv:
            self.sampled += 1
            if self._pending >= MAX_PENDING:
                self.dropped += 1
                return
            self._jobs.append((text_parts, id_parts, seam))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="capsule-tokenize-shadow",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued check has finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._cv.wait_for(lambda: bool(self._jobs), IDLE_EXIT_S)
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                self._check(*job)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _check(self, text_parts: Sequence[str], id_parts: Sequence[Sequence[int]],
               seam: int) -> None:
        text = "".join(text_parts)
        ids = list(itertools.chain.from_iterable(id_parts))
        try:
            full = list(self._ref.encode(text))
        except Exception as exc:   # a broken shadow reference must not kill the worker
            with self._cv:
                self.errors += 1
            log.warning("capsule: shadow tokenizer check failed to run (%s): %s",
                        self._family, exc)
            return
        with self._cv:
            self.checks += 1
            if full == ids:
                return
            self.mismatches += 1
        first = next((i for i, (x, y) in enumerate(zip(full, ids)) if x != y),
                     min(len(full), len(ids)))
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        log.warning("capsule: incremental tokenizer diverged from the reference: family=%s "
                    "text_sha256=%s chars=%d seam_offset=%d first_bad_token=%d (reference %d "
                    "tokens, incremental %d); this stream now re-encodes in full",
                    self._family, digest, len(text), seam, first, len(full), len(ids))
        self._on_mismatch()
