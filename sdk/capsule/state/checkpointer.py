"""Checkpointer: epochs of a session's execution state in a capsule store.

checkpoint: either stream the dirty pages into the store chunk by chunk and commit before
returning (wait=True: host memory holds one staging chunk of KV blocks), or copy them to host
bytes on the caller's thread and hand them to the background writer (wait=False).
restore: read and verify a whole epoch first (manifest bounded and checked field by field, its
binding, every page, the host state), build everything to install, and only then write it into
the live buffers in place with steps that cannot fail, so a bad capsule never leaves a session
half-restored. The newest epoch that is valid and matches this session's binding is restored;
the epochs skipped on the way are reported (Restored.skipped, and a warning on "capsule").
Threading: call from one thread at a time (the Session's lock does that).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import CapsuleCorrupt, CapsuleError, CapsuleMismatch, StoreError
from ..store.inputs import PageStream, check_name
from .binding import RESTORE_HINT, Binding
from .manifest import EpochCorrupt, Limits, Manifest, encode, parse
from .snapshot import Snapshotter, Staged
from .writer import BackgroundWriter

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("capsule")
HostState = tuple[dict, dict[str, bytes]]  # (small JSON metadata, named byte blobs)
# (host metadata, blobs) -> the step that installs them. Checks and builds everything first and
# raises (ValueError, KeyError, ...) without side effects; the step it returns cannot fail
HostLoader = Callable[[dict, dict[str, bytes]], Callable[[], None]]


@dataclass(frozen=True)
class Restored:
    epoch: int
    host: dict
    blobs: dict[str, bytes]
    skipped: list[str]


@dataclass(frozen=True)
class _Plan:
    """A checked epoch and everything its install writes."""
    manifest: Manifest
    staged: Staged
    install_host: Callable[[], None]
    base: int | None


class Checkpointer:
    """Binds a Snapshotter to a Store; owns the background writer."""

    def __init__(self, store: "Store", snapshotter: Snapshotter, binding: Binding,
                 kv_state: Callable[[], tuple[set[int], set[int]]], *, keep_epochs: int,
                 limits: Limits | None = None, stream_full: bool = False):
        self.store = store
        self.limits = limits or Limits()
        self.keep_epochs = keep_epochs
        self.snap = snapshotter
        self.binding = binding
        self._kv_state = kv_state            # () -> (dirty blocks, live blocks); clears the dirty log
        self._writer: BackgroundWriter | None = None
        self._next_epoch = (store.latest_epoch() or 0) + 1
        # after a restore of an older epoch, the next capsule is a delta over that epoch, not
        # over the newest one (whose pages the live state no longer has)
        self._base: int | None = None
        self._since_compact = 0
        self.last_bytes = 0
        # runtime.unified_memory: a full capture is written before checkpoint returns, even
        # with wait=False (streamed: no host copy of the whole pool on a shared-DRAM device)
        self.stream_full = stream_full

    # -- write --------------------------------------------------------------------------------
    def checkpoint(self, host: HostState, *, wait: bool, name: str | None) -> int:
        meta, blobs = host
        wait = wait or (self.stream_full and self.snap.full)
        if name is not None:
            self._check_name(name)
        epoch = self._next_epoch
        # refused (ValueError) before the dirty log is consumed: a manifest this SDK could not
        # read back is never written
        manifest = encode(self.binding, meta, {k: len(v) for k, v in blobs.items()}, self.limits)
        try:
            # a full capture (first epoch, after a failure) stands on its own: base 0, an empty
            # view, so nothing of older or abandoned epochs shows through it
            base = 0 if self.snap.full else self._base
            dirty, live = self._kv_state()
            # wait=True streams the KV blocks into the store chunk by chunk (nothing changes the
            # pool before it returns); a background write needs bytes that outlive this call
            pages = self.snap.capture(dirty, live, blobs, stream=wait)
            info_meta = {"streams": {m["name"]: m["n_ids"] for m in meta.get("streams", [])}}
            page_bytes = pages.nbytes if isinstance(pages, PageStream) else sum(len(p[2]) for p in pages)
            self.last_bytes = page_bytes + len(manifest)
            if wait:
                self.flush()
                got = self.store.write_epoch(pages, manifest, name=name, meta=info_meta, base=base).id
                if got != epoch:
                    raise StoreError(f"store assigned epoch {got}, session expected {epoch}")
            else:
                self._background().submit(epoch, pages, manifest, name, info_meta, base)
        except BaseException:
            self._resync()  # the dirty log and page digests were consumed: the next capsule is full
            raise
        self._next_epoch = epoch + 1
        self._base = None
        if wait:
            self._maintain([epoch])
        return epoch

    def _check_name(self, name: str) -> None:
        check_name(name)   # the form first: a name that looks like an id would resolve to one
        self.flush()  # named epochs are bookmarks: settle the queue so the name check is exact
        try:
            self.store.resolve(name)
        except (KeyError, StoreError):
            return
        raise ValueError(f"checkpoint name {name!r} is already used by a retained epoch; pick another")

    def flush(self) -> None:
        if self._writer is not None:
            try:
                self._writer.flush()
            except StoreError:
                self._resync()
                raise

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def _background(self) -> BackgroundWriter:
        if self._writer is None:
            self._writer = BackgroundWriter(self.store, on_durable=self._maintain)
        return self._writer

    def _maintain(self, epochs: Sequence[object]) -> None:
        """Keep the store bounded: drop old epochs each commit, compact every few epochs.

        Runs after the commit point (on the writer thread for wait=False checkpoints; the store
        serializes access). A failure here is logged and retried next time: the epochs are durable.
        """
        self._since_compact += len(epochs)
        try:
            self.store.retain(self.keep_epochs)
            if self._since_compact >= max(self.keep_epochs, 8):
                self.store.compact()
                self._since_compact = 0
        except (CapsuleError, OSError) as exc:   # a damaged index included: the epochs are committed
            log.warning("capsule store maintenance failed (epochs stay durable; retried later): %s", exc)

    def _resync(self) -> None:
        # what failed was not committed: the next capsule must stand on its own
        self._next_epoch = (self.store.latest_epoch() or 0) + 1
        self.snap.full = True

    # -- read ---------------------------------------------------------------------------------
    def restore_newest(self, load_host: HostLoader) -> Restored | None:
        """The newest committed epoch that verifies and matches this session, or None for an empty
        store. CapsuleMismatch when every epoch is another setup's, CapsuleCorrupt when none is valid."""
        self.flush()
        refused: dict[int, str] = {}   # epochs whose pages or host state failed the checks, and why
        while True:   # each pass either restores or refuses one more epoch
            parsed: dict[int, Manifest] = {}
            mismatched: list[tuple[int, list[str]]] = []

            def accept(epoch: int, data: bytes) -> None:   # raising skips the epoch (reported)
                if epoch in refused:
                    raise CapsuleCorrupt(refused[epoch])
                parsed[epoch] = self._accept(epoch, data, mismatched)
            try:
                found = self.store.load_newest_valid(accept, max_page_bytes=self.snap.max_page_bytes(),
                                                     max_manifest_bytes=self.limits.max_manifest_bytes)
            except CapsuleMismatch as exc:
                raise self._no_match(mismatched, len(refused)) from exc
            if found is None:
                return None
            epoch, data, pages, skipped = found
            manifest = parsed.get(epoch) or self._accept(epoch, data, [])
            try:
                plan = self._prepare(manifest, pages, load_host)
            except EpochCorrupt as exc:
                refused[epoch] = exc.detail
                continue
            self._install(plan)
            if skipped:
                log.warning("capsule store %s: restored epoch %d, not the newest: skipped %s", self.store.path,
                            epoch, " | ".join(skipped))
            # what the store's recovery did at open (an index rebuilt from the log, bytes set aside)
            # comes first: it is part of why this epoch is the one restored
            return Restored(epoch, manifest.host, plan.staged.blobs, [*self.store.recovery_report, *skipped])

    def restore(self, epoch_or_name: int | str, load_host: HostLoader) -> Restored:
        """That epoch, or an error (CapsuleCorrupt, CapsuleMismatch) with nothing changed."""
        self.flush()
        epoch = self.store.resolve(epoch_or_name)
        data, pages = self.store.load_epoch(epoch, max_page_bytes=self.snap.max_page_bytes(),
                                            max_manifest_bytes=self.limits.max_manifest_bytes)
        manifest = parse(epoch, data, self.limits)
        try:
            self.binding.check_matches(manifest.binding)
        except CapsuleMismatch as exc:
            raise CapsuleMismatch(f"epoch {epoch}: {exc}") from None
        plan = self._prepare(manifest, pages, load_host)
        self._install(plan)
        return Restored(epoch, manifest.host, plan.staged.blobs, [])

    def _accept(self, epoch: int, data: bytes, mismatched: list[tuple[int, list[str]]]) -> Manifest:
        """The parsed manifest if it is readable and this session's; else the store skips the epoch."""
        try:
            manifest = parse(epoch, data, self.limits)
        except EpochCorrupt as exc:
            raise CapsuleCorrupt(exc.detail) from None   # the store's report names the epoch
        diffs = self.binding.differences(manifest.binding)
        if diffs:
            mismatched.append((epoch, diffs))
            raise CapsuleMismatch("taken against a different setup; " + "; ".join(diffs))
        return manifest

    def _no_match(self, mismatched: list[tuple[int, list[str]]], n_refused: int) -> CapsuleMismatch:
        if not mismatched:   # not raised by our accept: nothing to add
            return CapsuleMismatch(f"store {self.store.path}: no epoch matches this session. {RESTORE_HINT}")
        newest, diffs = mismatched[0]
        other = f"; {n_refused} more could not be read" if n_refused else ""
        return CapsuleMismatch(f"capsule was taken against a different setup: no epoch of store "
                               f"{self.store.path} matches this session ({len(mismatched)} epoch(s) of another "
                               f"setup{other}); newest, epoch {newest}: " + "; ".join(diffs)
                               + f". {RESTORE_HINT}")

    def _prepare(self, manifest: Manifest, pages: dict, load_host: HostLoader) -> _Plan:
        """Check the epoch against the live layout and build what installing it writes; changes nothing."""
        try:
            staged = self.snap.prepare(pages, manifest.blob_sizes)
        except CapsuleCorrupt as exc:
            raise EpochCorrupt(manifest.epoch, str(exc)) from None
        try:
            install_host = load_host(manifest.host, staged.blobs)
        except KeyError as exc:
            raise EpochCorrupt(manifest.epoch, f"host state lacks {exc.args[0] if exc.args else exc}") from None
        except (ValueError, TypeError, RuntimeError, OverflowError, AttributeError, IndexError) as exc:
            # RuntimeError: torch refusing a generator device or state the manifest names
            raise EpochCorrupt(manifest.epoch, f"host state is inconsistent ({exc})") from None
        # after a restore of an older epoch, the next capsule is a delta over it (asked now: a
        # store error here still changes nothing)
        base = None if manifest.epoch == self.store.latest_epoch() else manifest.epoch
        return _Plan(manifest, staged, install_host, base)

    def _install(self, plan: _Plan) -> None:
        """Everything is verified and built: only in-place copies and assignments from here on."""
        self.snap.apply(plan.staged)
        self._base = plan.base
        plan.install_host()
        self._kv_state()  # the pool now equals the capsule: nothing is dirty
