"""Where the SDK keeps its per-machine caches (a bottom room: anything may import it)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Materialized builtin presets, weight digests and tokenizer tables ($CAPSULE_CACHE_DIR overrides)."""
    root = os.environ.get("CAPSULE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "capsule")
    return Path(root)
