"""What a Store's parts share: its folder, sealer and file ops, both locks, the current index and
the store's identity (a rebuilt index replaces both), what recovery did, and whether it is open.

Threading: `wlock` serializes writers and is taken before `lock`; `lock` (the state lock) guards
the index connection and segment deletion. Only a holder of both replaces the index (adopt).
"""
from __future__ import annotations

import threading
from pathlib import Path

from ..errors import StoreError
from .errors import UnknownEpoch
from .index import Index
from .loading import Ident
from .opening import Opened
from .records import Sealer
from .segments import FileOps


class Shared:
    """The state a Store's parts (epochs, keyed records, healing, upkeep) read and share."""

    def __init__(self, path: Path, opened: Opened, sealer: Sealer, fs: FileOps, lock_fd: int):
        self.path, self.sealer, self.fs = path, sealer, fs
        self.index: Index = opened.index   # replaced by adopt() after a rebuild
        self.seg_dir = path / "segments"
        self.lock_fd: int | None = lock_fd
        self.wlock = threading.RLock()   # serializes writers; taken before lock
        self.lock = threading.RLock()    # guards the index connection and segment deletion
        self.store_id, self.legacy_until = opened.store_id, opened.legacy_until
        # what recovery did at open (index rebuilt, bytes cut or set aside in quarantine/): logged
        # as warnings too; empty after a clean open (Store.recovery_report is this list)
        self.report: list[str] = list(opened.report)

    def adopt(self, opened: Opened) -> None:
        """A rebuilt index: continue on it and on the identity it found."""
        self.index = opened.index
        self.store_id, self.legacy_until = opened.store_id, opened.legacy_until

    def check_open(self) -> None:
        if self.lock_fd is None:
            raise StoreError(f"store {self.path} is closed")

    def ident(self) -> Ident:
        return Ident(self.store_id, self.legacy_until, self.seg_dir)

    def unknown(self, epoch_or_name: int | str) -> UnknownEpoch:
        return UnknownEpoch(f"no epoch {epoch_or_name!r} in store {self.path}; {self.known()}")

    def known(self) -> str:
        infos = self.index.epochs()
        if not infos:
            return "it holds no epochs yet"
        ids = [e.id for e in infos]
        shown = ", ".join(map(str, ids if len(ids) <= 6 else ids[:3] + ["..."] + ids[-3:]))
        names = [repr(e.name) for e in infos if e.name][:5]
        return f"it holds epochs {shown}" + (f" (named: {', '.join(names)})" if names else "")
