"""Opening a store's index: check it against the log, rebuild it from the log when it is not a
faithful cache, settle what lies past the committed end, and check the store's metadata.

Order (each step raises a typed error and changes nothing when it cannot proceed):
1. open index.sqlite; damaged (IndexCorrupt) while segment files exist: rebuild it;
2. metadata: format version (1..4; 1..3 are upgraded to 4 in place: upgrade.py), signing;
3. check_index (the log head): stale: rebuild;
4. settle_tail: lost commits found past the committed end: rebuild (then settle again).
A rebuild replaces the index by one built from the segments (rebuild.py) and reports it.

Threading: called with the store's LOCK held, before any other use of the store, or from
Store.repair with the writer and state locks held.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import StoreError
from . import keyeddb, rebuild, recovery, upgrade
from .errors import IndexCorrupt, SigningKeyError
from .index import Index
from .records import OLDER_FORMAT_VERSIONS, STORE_FORMAT_VERSION, RecordError, Sealer
from .segments import FileOps, list_segment_files

log = logging.getLogger("capsule")


@dataclass(frozen=True)
class Opened:
    index: Index
    store_id: str
    legacy_until: int         # epochs up to this one may have bare manifests (written before envelopes)
    report: tuple[str, ...]   # what recovery did (rebuilt, cut, set aside); empty for a clean open


def open_index(path: Path, sealer: Sealer, fs: FileOps, *, create: bool, force_rebuild: str | None = None,
               progress: Callable[[int, int], None] | None = None, held: rebuild.Held | None = None) -> Opened:
    """The opened index, checked against the log (rebuilt from it when needed). force_rebuild:
    rebuild in any case, saying why; held: what the index being replaced listed (a rebuild that
    would find none of it refuses instead of leaving an empty store)."""
    seg_dir = path / "segments"
    report: list[str] = []
    rebuild.discard_unfinished(path)   # a rebuild that crashed before its swap left its temporary index
    files = list_segment_files(seg_dir)
    index: Index | None = None
    why = force_rebuild
    if why is None:
        try:
            index = Index.open(path / "index.sqlite", create=create, segments_exist=bool(files))
        except IndexCorrupt as exc:
            if not files:
                raise
            why = f"the index is damaged: {exc}"
    try:
        if index is not None:
            try:
                meta = _check_meta(path, index, sealer)
                why = recovery.check_index(index, seg_dir, sealer)
                if why is None:
                    why, lines = recovery.settle_tail(path, index, sealer, fs, after_rebuild=False)
                    report += lines
            except IndexCorrupt as exc:
                if not files:
                    raise
                why = f"the index is damaged: {exc}"
        if why is not None:
            old, held = _salvage_meta(index), held_by(index) or held
            if index is not None:
                index.close()
                index = None
            report += rebuild.rebuild_index(path, sealer, store_id=old.get("store_id"), created=old.get("created"),
                                            why=why, progress=progress, held=held)
            index = Index.open(path / "index.sqlite", create=False, segments_exist=True)
            meta = _check_meta(path, index, sealer)
            _, lines = recovery.settle_tail(path, index, sealer, fs, after_rebuild=True)
            report += lines
    except BaseException as exc:
        if index is not None:
            index.close()
        if isinstance(exc, RecordError):   # a file that changed under recovery: typed, like all damage
            raise IndexCorrupt(f"store {path}: recovery could not read the log ({exc}); nothing more was "
                               f"changed, open it again") from exc
        raise
    for line in report:
        log.warning("capsule store %s: %s", path, line)
    return Opened(index, meta["store_id"], int(meta.get("legacy_until") or 0), tuple(report))


def _salvage_meta(index: Index | None) -> dict[str, str]:
    """What the old index still says of the store (its id, creation time), if anything: hints."""
    if index is None:
        return {}
    try:
        meta = index.get_meta()
    except (IndexCorrupt, StoreError):
        return {}
    return {k: meta[k] for k in ("store_id", "created") if k in meta}


def held_by(index: Index | None) -> rebuild.Held | None:
    """How many epochs and keyed records a (possibly damaged) index lists, when it can still tell."""
    if index is None:
        return None
    try:
        return rebuild.Held(len(index.epoch_ids()), keyeddb.count(index))
    except (IndexCorrupt, StoreError):
        return None


def _check_meta(path: Path, index: Index, sealer: Sealer) -> dict[str, str]:
    meta = index.get_meta()
    if "store_id" not in meta:  # a new store
        store_id = uuid.uuid4().hex
        meta = {"store_id": store_id, "format_version": str(STORE_FORMAT_VERSION), "created": str(time.time()),
                "signed": "1" if sealer.signed else "0", "key_check": sealer.key_check(store_id),
                "legacy_until": "0"}
        index.init_meta(meta)
        os.chmod(path, 0o700)
        return meta
    known = tuple(map(str, (*OLDER_FORMAT_VERSIONS, STORE_FORMAT_VERSION)))
    if meta.get("format_version") not in known:
        raise StoreError(f"store {path} has format version {meta.get('format_version')}; this SDK reads "
                         f"{', '.join(known)} (upgrade the SDK)")
    if meta.get("signed") == "1" and not sealer.signed:
        raise SigningKeyError(f"store {path} is signed: open it with its sign_key")
    if meta.get("signed") != "1" and sealer.signed:
        raise SigningKeyError(f"store {path} was created without signing; open it without sign_key")
    if sealer.signed and sealer.key_check(meta["store_id"]) != meta.get("key_check"):
        raise SigningKeyError(f"sign_key is not the key store {path} was created with")
    if meta["format_version"] != str(STORE_FORMAT_VERSION):
        meta = {**meta, **upgrade.upgrade(index, path / "segments", sealer, meta["store_id"], meta)}
    return meta
