"""A GGUF file's own tokenizer: its metadata as a tokenizer.json + tokenizer_config.json folder.

The files are rebuilt from the metadata on every open and compared byte for byte with what the
cache folder holds: equal files are reused untouched (their stamps keep the tokenizer's disk
cache valid), anything else (missing, damaged, edited) is replaced atomically. So a cache entry
is never trusted: what loads is always what the GGUF says.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping

from ..errors import TokenizerError
from ..paths import cache_dir, write_private
from ..tokenize.gguf_vocab import tokenizer_files


def tokenizer_folder(meta: Mapping[str, object], digest: str) -> Path:
    """The folder holding the tokenizer files of the GGUF whose sha256 is `digest`.

    TokenizerError when the metadata holds no usable tokenizer (it names the field)."""
    files = tokenizer_files(meta)
    folder = cache_dir() / "gguf" / f"{digest}.tokenizer"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, text in files.items():
            _put(folder / name, text.encode("utf-8"))
        return folder
    except OSError:
        pass   # a read-only cache: this process gets a private copy instead
    tmp = Path(tempfile.mkdtemp(prefix="capsule-gguf-tokenizer-"))
    try:
        for name, text in files.items():
            _put(tmp / name, text.encode("utf-8"))
    except OSError as exc:
        raise TokenizerError(f"cannot write the GGUF's tokenizer files anywhere ({exc.strerror or exc}); "
                             "set CAPSULE_CACHE_DIR to a writable folder") from None
    return tmp


def _put(path: Path, data: bytes) -> None:
    """Write `data` to `path` unless it already holds exactly that (no symlink is followed)."""
    if path.is_file() and not path.is_symlink() and path.stat().st_size == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    write_private(path, data)
