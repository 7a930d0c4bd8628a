"""The files whose bytes decide each vocabulary: the disk cache stamps them (size, mtime)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Sequence

DATA = "share:"   # a record's package "share:<name>": <prefix>/share/capsule-vocab/<name>


def package_dir(module: str) -> Path | None:
    """The folder of a package (or of a plain module), found without importing it; for
    ``share:<name>``, that data folder of this Python's environment (installed by ``make``)."""
    if module.startswith(DATA):
        folder = data_dir(module)
        return folder if folder.is_dir() else None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    dirs = list(spec.submodule_search_locations or ()) if spec else []
    if dirs:
        return Path(dirs[0])
    return Path(spec.origin).parent if spec and spec.origin else None


def data_dir(package: str) -> Path:
    """Where a ``share:<name>`` record's files live: this environment's data folder."""
    return Path(sys.prefix) / "share" / "capsule-vocab" / package[len(DATA):]


def package_files(package: str, library: str, files: Sequence[str]) -> list[Path] | None:
    """A family's files under its package's folder, then its library's; None if either is absent.

    The library running a vocabulary decides its tables too, so an upgraded package or library
    never meets a stale cache entry.
    """
    root = package_dir(package)
    return None if root is None else _with_library([root / f for f in files], library)


def file_sources(path: Path) -> list[Path] | None:
    """The files deciding a tokenizer file's tables: it (and its tokenizer_config.json)."""
    if path.suffix.lower() == ".tiktoken":
        return _with_library([path], "tiktoken")
    return _with_library([path, path.parent / "tokenizer_config.json"], "tokenizers")


def _with_library(found: list[Path], library: str) -> list[Path] | None:
    lib_dir = package_dir(library)
    return None if lib_dir is None else [*found, lib_dir / "__init__.py"]
