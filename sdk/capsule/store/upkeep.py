"""A Store's upkeep: retention, compaction, verification and stats (maintenance.py does the work;
this part takes the locks and turns failures into the store's errors).

Threading: retain and compact are writers (the writer lock; the state lock around index access);
verify holds both locks; stats only the state lock.
"""
from __future__ import annotations

from ..errors import StoreError
from . import maintenance
from .commit import Committer
from .errors import IndexCorrupt
from .healing import Healer
from .info import VerifyReport
from .shared import Shared


class Upkeep:
    """Store.retain, compact, verify and stats over the shared index and the committer's writer."""

    def __init__(self, shared: Shared, commit: Committer, heal: Healer):
        self._shared, self._commit, self._heal = shared, commit, heal

    def retain(self, keep: int) -> int:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        sh = self._shared
        with sh.wlock:
            sh.check_open()
            return self._heal.writing(lambda: self._retain_locked(keep))

    def _retain_locked(self, keep: int) -> int:
        with self._shared.lock:
            return maintenance.retain(self._shared.index, keep)

    def compact(self, threshold: float) -> int:
        sh = self._shared
        with sh.wlock:
            sh.check_open()
            self._commit.sync()  # staged bytes must not sit between compaction's copies
            try:
                return maintenance.compact(sh.index, self._commit.writer, sh.fs, sh.seg_dir, sh.sealer, sh.lock,
                                           threshold)
            except (OSError, StoreError) as exc:
                self._commit.fail(exc, "compaction")

    def verify(self) -> VerifyReport:
        sh = self._shared
        with sh.wlock, sh.lock:
            sh.check_open()
            try:
                return maintenance.verify(sh.index, sh.seg_dir, sh.sealer)
            except IndexCorrupt as exc:   # reported, not repaired: verify only looks
                return VerifyReport(False, (), (), 0, 0, (f"index: {exc}; `capsule repair` rebuilds it from "
                                                          f"the segment log",))

    def stats(self) -> dict[str, int | None]:
        sh = self._shared
        with sh.lock:
            sh.check_open()
            return maintenance.stats(sh.index, sh.path)
