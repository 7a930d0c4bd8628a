"""Healing a Store's index: rebuilt from the segment log when asked (repair), or when a read or a
writer's index step finds it damaged (IndexCorrupt): rebuilt once per call, then the step runs again.

Threading: repair holds the writer and state locks; reading() runs its read under the state lock
only; writing() runs its step under whatever its caller holds (a writer: the writer lock).
"""
from __future__ import annotations

from typing import Any, Callable

from .commit import Committer
from .errors import IndexCorrupt, IndexStale
from .index import Index
from .keyed import Keyed
from .opening import held_by, open_index
from .shared import Shared


class Healer:
    """Rebuilds the shared index in place and re-attaches the committer and keyed records to it."""

    def __init__(self, shared: Shared, commit: Committer, keyed: Keyed):
        self._shared, self._commit, self._keyed = shared, commit, keyed

    def repair(self, why: str, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """See Store.repair."""
        sh = self._shared
        with sh.wlock, sh.lock:
            sh.check_open()
            self._commit.drop_staged()   # never synced, never acknowledged: cut, not adopted
            held = held_by(sh.index)
            sh.index.close()
            try:
                opened = open_index(sh.path, sh.sealer, sh.fs, create=False, force_rebuild=why,
                                    progress=progress, held=held)
            except BaseException:
                sh.index = Index.open(sh.path / "index.sqlite", create=False, segments_exist=True)
                self._commit.attach_index(sh.index)
                raise
            sh.adopt(opened)
            self._commit.attach_index(opened.index, opened.store_id)
            self._commit.reset_to_committed()
            sh.report += opened.report
            self._keyed.generation += 1
            return list(opened.report)

    def once(self, exc: IndexCorrupt, repaired: list[bool]) -> None:
        """A read found the index wrong: rebuild it, once per call (the second time, raise). A
        rebuild that refuses (the log cannot stand in for the index) leaves the index as it was:
        the read is done again without suspecting it, and falls back or fails as damage."""
        if repaired:
            raise exc
        repaired.append(True)
        try:
            self.repair(str(exc))
        except IndexCorrupt as refused:
            if not isinstance(exc, IndexStale):
                raise exc from refused       # the index itself cannot be read: nothing to fall back on
            self._shared.report.append(f"the index could not be rebuilt from the log ({refused})")

    def writing(self, write: Callable[[], Any]) -> Any:
        """Run an index step of a writer (before it appends anything, or all in one transaction),
        holding the writer lock; a damaged index is rebuilt once, then the step runs again."""
        repaired: list[bool] = []
        while True:
            try:
                return write()
            except IndexCorrupt as exc:
                self.once(exc, repaired)

    def reading(self, read: Callable[[], Any]) -> Any:
        """Run an index read under the state lock; a damaged index is rebuilt once, then read again."""
        return self.reading_told(lambda rebuilt: read())

    def reading_told(self, read: Callable[[bool], Any]) -> Any:
        """reading() for a read that must know whether this call rebuilt the index: read(rebuilt)."""
        repaired: list[bool] = []
        while True:
            try:
                with self._shared.lock:
                    self._shared.check_open()
                    return read(bool(repaired))
            except IndexCorrupt as exc:
                self.once(exc, repaired)
