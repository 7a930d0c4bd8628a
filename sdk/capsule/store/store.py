"""Store: the commit protocol and recovery over segments (records) and index.sqlite (page map).

Commit protocol: append records -> fsync the segments (+ the folder when a file was created)
-> one SQLite transaction (THE commit point). Recovery cuts the active segment back to its
committed end. See docs/FORMAT.md.

It also keeps persistent memory facts (facts.py): an index row plus one KV record each.

Threading: a Store may be shared by threads. Writers (stage_epoch, sync, write_epoch, retain,
compact, close, and the fact writers) are serialized by a writer lock; readers (epochs,
latest_epoch, resolve, load_epoch, load_newest_valid, stats, the fact readers) take only the
state lock, which a writer holds just for its index transaction: readers never wait for record
appends or segment fsyncs, and a long load delays only the next commit. verify() holds both locks.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import CapsuleCorrupt, CapsuleError, CapsuleMismatch, StoreError
from . import lockfile, maintenance
from .commit import Committer
from .errors import PageCorrupt, SigningKeyError, UnknownEpoch
from .facts import FactsMixin
from .index import Index
from .info import EpochInfo, VerifyReport
from .reader import read_manifest, read_pages
from .records import FACTS_FORMAT_VERSION, FORMAT_VERSION, Sealer
from .segments import FileOps, SegmentReader, list_segment_files


# what a store puts in its folder besides LOCK (a failed open of a new store removes them again)
OWNED = ("segments", "index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "index.sqlite-journal")


class Store(FactsMixin):
    """A durable, crash-consistent, append-only page store (bytes in, bytes out), which also keeps
    memory facts (add_fact, fact_kv, search_facts, ...: see facts.py). Use Store.open."""

    def __init__(self, path: Path, index: Index, sealer: Sealer, fs: FileOps, segment_bytes: int,
                 lock_fd: int):
        self.path, self._index, self._sealer, self._fs = path, index, sealer, fs
        self._seg_dir = path / "segments"
        self._lock_fd: int | None = lock_fd
        self._wlock = threading.RLock()   # serializes writers; taken before _lock
        self._lock = threading.RLock()    # guards the index connection and segment deletion
        self._commit = Committer(path, index, sealer, fs, segment_bytes, self._lock)

    # -- lifetime -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = True, sign_key: bytes | None = None,
             segment_bytes: int = 64 << 20, fs: FileOps | None = None) -> "Store":
        """Open (or create) the store folder, take its LOCK and recover. O(1) in history length."""
        path = Path(path)
        if not isinstance(segment_bytes, int) or not 4096 <= segment_bytes <= 1 << 40:
            raise ValueError(f"segment_bytes must be an int in 4096..2**40, got {segment_bytes!r}")
        sealer = Sealer(sign_key)
        if path.exists() and not path.is_dir():
            raise StoreError(f"store path {str(path)!r} is a regular file; give a folder path")
        if not create and not (path / "index.sqlite").exists() and not (path / "segments").exists():
            raise StoreError(f"no capsule store at {path} (pass create=True to make one)")
        # a failed open of a NEW store removes what it added (folder, LOCK, index files, segments/)
        folder = lockfile.lock_folder(path, is_new=lambda: not holds_store(path), owned=OWNED)
        try:
            seg_dir = path / "segments"
            seg_dir.mkdir(mode=0o700, exist_ok=True)
            files = list_segment_files(seg_dir)
            index = Index.open(path / "index.sqlite", create=create, segments_exist=bool(files))
            try:
                _check_signing(path, index, sealer)
                store = cls(path, index, sealer, fs or FileOps(), segment_bytes, folder.fd)
                store._recover()
                return store
            except OSError as exc:
                index.close()
                raise StoreError(f"store {path} could not be recovered: {exc}") from exc
            except BaseException:
                index.close()
                raise
        except BaseException:
            folder.abandon()
            raise

    def close(self) -> None:
        """Release the lock. Staged epochs that were not synced are discarded (never acknowledged)."""
        with self._wlock, self._lock:
            if self._lock_fd is None:
                return
            try:
                self._commit.discard()
            finally:
                self._index.close()
                lockfile.release(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- write ----------------------------------------------------------------------------------
    def write_epoch(self, pages: Iterable[tuple[str, int, Any]], manifest: bytes, *, name: str | None = None,
                    meta: dict | None = None, base: int | None = None) -> EpochInfo:
        """Append and commit one epoch (plus any staged ones). Durable when it returns."""
        with self._wlock:
            self._check_open()
            staged = self._commit.stage(pages, manifest, name, meta, base)
            self._commit.sync()
            return staged.info

    def stage_epoch(self, pages: Iterable[tuple[str, int, Any]], manifest: bytes, *, name: str | None = None,
                    meta: dict | None = None, base: int | None = None) -> int:
        """Append an epoch's records without fsync or commit; returns the id sync() will commit it as.
        base: the epoch this delta applies to (default: the previous one; 0: an empty view)."""
        with self._wlock:
            self._check_open()
            return self._commit.stage(pages, manifest, name, meta, base).info.id

    def sync(self) -> list[EpochInfo]:
        """Group commit: one fsync pass + one transaction for every staged epoch, oldest first."""
        with self._wlock:
            self._check_open()
            return self._commit.sync()

    def discard_staged(self) -> list[int]:
        """Drop staged, unsynced epochs and cut their bytes (a writer whose batch failed midway
        must not leave half a batch staged for the next sync to commit). Returns their ids."""
        with self._wlock:
            ids = [s.info.id for s in self._commit.staged]
            if ids:
                self._commit.staged.clear()
                try:
                    self._commit.reset_to_committed()
                except OSError:
                    self._commit.poison()   # the next write cuts them first, or raises
            return ids

    def _recover(self) -> None:
        with self._lock:
            maintenance.delete_dead_segments(self._index, self._fs, self._seg_dir)
        self._commit.reset_to_committed()

    # -- read ---------------------------------------------------------------------------------
    def epochs(self) -> list[EpochInfo]:
        """Committed, retained epochs, oldest first."""
        with self._lock:
            self._check_open()
            return self._index.epochs()

    def latest_epoch(self) -> int | None:
        with self._lock:
            self._check_open()
            return self._index.latest()

    def resolve(self, epoch_or_name: int | str) -> int:
        """The id of a retained epoch given its id or name (a str of digits is tried as an id too)."""
        with self._lock:
            self._check_open()
            found = None
            if isinstance(epoch_or_name, int) and not isinstance(epoch_or_name, bool):
                found = epoch_or_name if self._index.manifest_ref(epoch_or_name) else None
            elif isinstance(epoch_or_name, str):
                found = self._index.by_name(epoch_or_name)
                if found is None and epoch_or_name.strip().isdigit():
                    found = int(epoch_or_name) if self._index.manifest_ref(int(epoch_or_name)) else None
            if found is None:
                raise UnknownEpoch(f"no epoch {epoch_or_name!r} in store {self.path}; {self._known()}")
            return found

    def _known(self) -> str:
        infos = self._index.epochs()
        if not infos:
            return "it holds no epochs yet"
        ids = [e.id for e in infos]
        shown = ", ".join(map(str, ids if len(ids) <= 6 else ids[:3] + ["..."] + ids[-3:]))
        names = [repr(e.name) for e in infos if e.name][:5]
        return f"it holds epochs {shown}" + (f" (named: {', '.join(names)})" if names else "")

    def load_epoch(self, epoch: int, *, max_page_bytes: int | None = None
                   ) -> tuple[bytes, dict[str, dict[int, bytes]]]:
        """(manifest, {region: {index: page}}): the epoch's full view, every record verified.
        max_page_bytes: refuse (PageCorrupt) a page whose record claims a bigger payload, before
        anything is read or allocated for it (the caller knows its largest page)."""
        with self._lock:
            self._check_open()
            manifest = self._index.manifest_ref(epoch)
            if manifest is None:
                raise UnknownEpoch(f"no epoch {epoch!r} in store {self.path}; {self._known()}")
            with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
                man = read_manifest(segs, self._sealer, manifest, epoch)
                return man, read_pages(segs, self._sealer, self._index.view(epoch), epoch, max_page_bytes)

    def load_newest_valid(self, accept: Callable[[int, bytes], None] | None = None, *,
                          max_page_bytes: int | None = None
                          ) -> tuple[int, bytes, dict[str, dict[int, bytes]], list[str]] | None:
        """Newest epoch whose every record verifies: (epoch, manifest, pages, skipped reports).
        None when the store holds no epoch; CapsuleCorrupt when it holds some and none is valid.

        accept(epoch, manifest): called before an epoch's pages are read; raising a CapsuleError
        (CapsuleCorrupt: the manifest is unreadable; CapsuleMismatch: it belongs to another
        model) skips the epoch, reported like a damaged one. When no epoch is valid and some
        were refused with CapsuleMismatch, the newest such CapsuleMismatch is raised."""
        with self._lock:
            self._check_open()
            ids = self._index.epoch_ids()
            bad: set[tuple[int | None, int | None]] = set()
            skipped: list[str] = []
            mismatch: CapsuleMismatch | None = None
            with SegmentReader(self._seg_dir, self._sealer.signed) as segs:
                for epoch in reversed(ids):
                    manifest, view = self._index.manifest_ref(epoch), self._index.view(epoch)
                    if manifest is None:
                        continue  # dropped concurrently
                    if any(ref.location in bad for ref in (manifest, *view)):
                        skipped.append(f"epoch {epoch}: uses a record already found corrupt")
                        continue
                    try:
                        man = read_manifest(segs, self._sealer, manifest, epoch)
                        if accept is not None:
                            accept(epoch, man)
                        pages = read_pages(segs, self._sealer, view, epoch, max_page_bytes)
                    except PageCorrupt as exc:
                        bad.add((exc.segment, exc.offset))
                        skipped.append(exc.summary)
                        continue
                    except CapsuleMismatch as exc:
                        mismatch = mismatch or exc
                        skipped.append(f"epoch {epoch}: {exc}")
                        continue
                    except CapsuleError as exc:
                        skipped.append(f"epoch {epoch}: {exc}")
                        continue
                    return epoch, man, pages, skipped
        if not ids:
            return None
        if mismatch is not None:
            others = [s for s in skipped if not s.endswith(str(mismatch))]
            raise CapsuleMismatch(f"{mismatch}" + (f" (other epochs skipped: {' | '.join(others[:8])})"
                                                   if others else "")) from mismatch
        raise CapsuleCorrupt(f"store {self.path} holds {len(ids)} epochs ({ids[0]}..{ids[-1]}) and none is "
                             f"fully valid; skipped: {' | '.join(skipped[:8])}. Keep a copy of the folder "
                             f"and run `capsule verify`")

    # -- maintenance (see maintenance.py) ---------------------------------------------------------
    def retain(self, keep: int) -> int:
        """Drop unnamed epochs older than the `keep` newest (named epochs stay); returns how many."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        with self._wlock, self._lock:
            self._check_open()
            return maintenance.retain(self._index, keep)

    def compact(self, *, threshold: float = 0.5) -> int:
        """Move live records out of sealed segments less than `threshold` live; returns bytes reclaimed."""
        with self._wlock:
            self._check_open()
            self._commit.sync()  # staged bytes must not sit between compaction's copies
            try:
                return maintenance.compact(self._index, self._commit.writer, self._fs, self._seg_dir,
                                           self._sealer, self._lock, threshold)
            except (OSError, StoreError) as exc:
                self._commit.fail(exc, "compaction")

    def verify(self) -> VerifyReport:
        """Read and check every record of every segment and every index row (facts included)."""
        with self._wlock, self._lock:
            self._check_open()
            return maintenance.verify(self._index, self._seg_dir, self._sealer)

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            self._check_open()
            return maintenance.stats(self._index, self.path)

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise StoreError(f"store {self.path} is closed")


def _check_signing(path: Path, index: Index, sealer: Sealer) -> None:
    meta = index.get_meta()
    if "store_id" not in meta:  # a new store
        store_id = uuid.uuid4().hex
        index.init_meta({"store_id": store_id, "format_version": str(FORMAT_VERSION),
                         "created": str(time.time()), "signed": "1" if sealer.signed else "0",
                         "key_check": sealer.key_check(store_id)})
        os.chmod(path, 0o700)
        return
    if meta.get("format_version") not in (str(FORMAT_VERSION), str(FACTS_FORMAT_VERSION)):
        raise StoreError(f"store {path} has format version {meta.get('format_version')}; this SDK reads "
                         f"{FORMAT_VERSION} and {FACTS_FORMAT_VERSION} (upgrade the SDK)")
    if meta.get("signed") == "1" and not sealer.signed:
        raise SigningKeyError(f"store {path} is signed: open it with its sign_key")
    if meta.get("signed") != "1" and sealer.signed:
        raise SigningKeyError(f"store {path} was created without signing; open it without sign_key")
    if sealer.signed and sealer.key_check(meta["store_id"]) != meta.get("key_check"):
        raise SigningKeyError(f"sign_key is not the key store {path} was created with")


def holds_store(path: Path) -> bool:
    """Whether the folder holds a store's data (a non-empty index or a segment file)."""
    index = path / "index.sqlite"
    if index.exists() and index.stat().st_size > 0:
        return True
    return (path / "segments").is_dir() and bool(list_segment_files(path / "segments"))
