"""Checkpointer: epochs of a session's execution state in a capsule store.

checkpoint: stage the dirty pages (host copies, on the caller's thread) and either write
them durably before returning (wait=True) or hand them to the background writer.
restore: read and verify a whole epoch first, check its binding, and only then write it into
the live buffers in place, so a bad capsule never leaves a session half-restored.
Threading: call from one thread at a time (the Session's lock does that).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import CapsuleCorrupt, CapsuleMismatch, StoreError
from ..store.inputs import check_name
from .binding import Binding
from .snapshot import Snapshotter
from .writer import BackgroundWriter

log = logging.getLogger("capsule")
HostState = tuple[dict, dict[str, bytes]]  # (small JSON metadata, named byte blobs)
# (host metadata, blobs) -> the step that installs them; raises ValueError without side effects
HostLoader = Callable[[dict, dict[str, bytes]], Callable[[], None]]


@dataclass(frozen=True)
class Restored:
    epoch: int
    host: dict
    blobs: dict[str, bytes]
    skipped: list[str]


class Checkpointer:
    """Binds a Snapshotter to a Store; owns the background writer."""

    def __init__(self, store: Any, snapshotter: Snapshotter, binding: Binding,
                 kv_state: Callable[[], tuple[set[int], set[int]]], *, keep_epochs: int):
        self.store = store
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

    # -- write --------------------------------------------------------------------------------
    def checkpoint(self, host: HostState, *, wait: bool, name: str | None) -> int:
        meta, blobs = host
        if name is not None:
            self._check_name(name)
        epoch = self._next_epoch
        try:
            # a full capture (first epoch, after a failure) stands on its own: base 0, an empty
            # view, so nothing of older or abandoned epochs shows through it
            base = 0 if self.snap.full else self._base
            dirty, live = self._kv_state()
            pages = self.snap.capture(dirty, live, blobs)
            manifest = json.dumps({"binding": self.binding.to_dict(), "host": meta,
                                   "blobs": {k: len(v) for k, v in blobs.items()}},
                                  separators=(",", ":"), allow_nan=False).encode()
            info_meta = {"streams": {m["name"]: m["n_ids"] for m in meta.get("streams", [])}}
            self.last_bytes = sum(len(p[2]) for p in pages) + len(manifest)
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
        except (StoreError, OSError) as exc:
            log.warning("capsule store maintenance failed (epochs stay durable; retried later): %s", exc)

    def _resync(self) -> None:
        # what failed was not committed: the next capsule must stand on its own
        self._next_epoch = (self.store.latest_epoch() or 0) + 1
        self.snap.full = True

    # -- read ---------------------------------------------------------------------------------
    def restore_newest(self, load_host: HostLoader) -> Restored | None:
        """The newest committed epoch whose every record verifies, or None for an empty store."""
        self.flush()
        found = self.store.load_newest_valid()
        if found is None:
            return None
        epoch, manifest, pages, skipped = found
        return self._apply(epoch, manifest, pages, skipped, load_host)

    def restore(self, epoch_or_name: int | str, load_host: HostLoader) -> Restored:
        self.flush()
        epoch = self.store.resolve(epoch_or_name)
        manifest, pages = self.store.load_epoch(epoch)
        return self._apply(epoch, manifest, pages, [], load_host)

    def _apply(self, epoch: int, manifest: bytes, pages: dict, skipped: list[str],
               load_host: HostLoader) -> Restored:
        try:
            doc = json.loads(manifest)
            saved = Binding.from_dict(doc["binding"])
            host, sizes = doc["host"], doc["blobs"]
            if not isinstance(host, dict) or not isinstance(sizes, dict):
                raise TypeError("host/blobs are not objects")
            if any(type(v) is not int or not 0 <= v < 1 << 40 for v in sizes.values()):
                raise ValueError("blob sizes must be ints in 0..2^40")
        except CapsuleMismatch:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CapsuleCorrupt(f"epoch {epoch}: manifest is unreadable ({exc})") from None
        self.binding.check_matches(saved)
        blobs = self.snap.check(pages, dict(sizes))
        try:
            install_host = load_host(host, blobs)
        except (ValueError, KeyError, TypeError, RuntimeError, OverflowError, AttributeError) as exc:
            # RuntimeError: torch refusing a generator device or state the manifest names
            raise CapsuleCorrupt(f"epoch {epoch}: host state is inconsistent ({exc})") from None
        # everything is verified: from here on the live state changes
        self.snap.apply(pages, blobs)
        self._base = None if epoch == self.store.latest_epoch() else epoch
        install_host()
        self._kv_state()  # the pool now equals the capsule: nothing is dirty
        return Restored(epoch, host, blobs, skipped)
