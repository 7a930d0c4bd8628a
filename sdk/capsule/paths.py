"""Where the SDK keeps its per-machine caches, and how it maps a file (a bottom room: anything
may import it)."""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

from .errors import ModelLoadError


def cache_dir() -> Path:
    """Materialized builtin presets, weight digests and tokenizer tables ($CAPSULE_CACHE_DIR overrides)."""
    root = os.environ.get("CAPSULE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "capsule")
    return Path(root)


def write_private(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write `data` to `path` atomically: a temporary file of its own beside it (mode 0600, so two
    writers never share one), fsynced, then published (``publish``): renamed over `path` (a
    planted symlink is replaced itself, its target untouched), or with replace=False only where
    nothing is there yet. On failure the temporary file is removed and `path` is as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path, replace)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def publish(tmp: str, path: Path, replace: bool) -> None:
    """Move the finished temporary file `tmp` to `path`: over whatever is there, or (replace=False)
    only where nothing is: a cache entry two processes fill at once then stays the first one's,
    so a file another process has mapped, or a restore kit has recorded (size, mtime), is not
    swapped from under it; the later bytes are dropped. `tmp` is gone afterwards."""
    if replace:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)          # fails where anything is at `path`
    except FileExistsError:
        pass                        # another writer's entry stands
    except OSError:                 # no hard links on this file system: a rename while still free
        if not os.path.lexists(path):
            os.replace(tmp, path)
            return
    os.unlink(tmp)


def map_file(path: Path, min_size: int, kind: str, access: int = mmap.ACCESS_READ) -> mmap.mmap:
    """The whole file memory-mapped (its len() is the file's size); ModelLoadError when it cannot
    be read or is shorter than min_size bytes (not a `kind` file)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < max(min_size, 1):   # an empty file cannot be mapped
                raise ModelLoadError(f"{path} is not a {kind} file ({size} bytes)")
            return mmap.mmap(f.fileno(), 0, access=access)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
