"""Shared by the lite restore tests: a changed weights file is refused, checked on a private copy
of the file, so no test changes the cache files the other tests' kits map (under xdist they run
at the same time)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from capsule.errors import CapsuleMismatch
from capsule.lite import LiteResume
from capsule.lite.kit import kit_path
from capsule.lite.kitfile import KitFile, pack


def kit_over_a_copy(store: Path, tmp_path: Path, suffix: str) -> tuple[Path, Path]:
    """(a kit, a weights file): store's kit rewritten to map its weights file ending in ``suffix``
    from a copy in tmp_path (the same bytes and mtime, so the kit still matches it)."""
    f = KitFile.open(kit_path(store))
    meta = json.loads(json.dumps(f.meta))
    blobs = {name: bytes(f.blob(name)) for name in meta.pop("blobs")}
    entry = next(e for e in meta["files"] if e["path"].endswith(suffix))
    copy = tmp_path / Path(entry["path"]).name
    shutil.copy2(entry["path"], copy)
    entry["path"] = str(copy)
    kit = tmp_path / "copy.kit"
    kit.write_bytes(b"".join(pack(meta, blobs)))
    return kit, copy


def check_a_changed_weights_file_is_refused(store: Path, tmp_path: Path, suffix: str) -> None:
    kit, copy = kit_over_a_copy(store, tmp_path, suffix)
    LiteResume.open(store, kit=kit).close()                     # the copy serves as the file
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(CapsuleMismatch, match="changed since the kit was written"):
        LiteResume.open(store, kit=kit)
