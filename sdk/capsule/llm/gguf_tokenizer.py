"""A GGUF file's own tokenizer: its metadata as a tokenizer.json + tokenizer_config.json folder.

The folder is keyed by the GGUF's sha256. Beside the files, a manifest records their sha256
and a fingerprint of the code that wrote them; an open reuses the folder only when every file
hashes to its manifest entry and the fingerprint is this code's (~5 ms), and otherwise builds
the files from the metadata again (~200 ms for SmolLM2's 49k tokens and merges: it was paid on
every open, restores included) and replaces them atomically, manifest last. So a damaged,
edited, missing or stale file never loads: what loads is what this code makes of that GGUF.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Mapping

from ..errors import TokenizerError
from ..paths import cache_dir, write_private
from ..tokenize import gguf_vocab, gguf_vocab_fields, patterns
from ..tokenize.gguf_vocab import tokenizer_files

MANIFEST = "capsule-manifest.json"
NAMES = frozenset({"tokenizer.json", "tokenizer_config.json"})   # what tokenizer_files writes
MAX_FILE = 1 << 28                                                # bytes, per file read back
_WRITERS = (gguf_vocab, gguf_vocab_fields, patterns)              # the code the files come from


def tokenizer_folder(meta: Mapping[str, object], digest: str) -> Path:
    """The folder holding the tokenizer files of the GGUF whose sha256 is `digest`.

    TokenizerError when the metadata holds no usable tokenizer (it names the field)."""
    folder = cache_dir() / "gguf" / f"{digest}.tokenizer"
    key = _fingerprint(digest)
    if _intact(folder, key):
        return folder
    files = tokenizer_files(meta)
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, text in files.items():
            _put(folder / name, text.encode("utf-8"))
        manifest = {"key": key, "files": {n: hashlib.sha256(t.encode("utf-8")).hexdigest()
                                          for n, t in files.items()}}
        _put(folder / MANIFEST, json.dumps(manifest, sort_keys=True).encode())
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


def _fingerprint(digest: str) -> str:
    """The GGUF's digest and the source of the modules that turn its metadata into files."""
    h = hashlib.sha256(digest.encode())
    for module in _WRITERS:
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def _read(path: Path) -> bytes | None:
    """A regular file's bytes (no symlink followed, at most MAX_FILE), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
            return None
        return f.read(MAX_FILE + 1)


def _intact(folder: Path, key: str) -> bool:
    """Whether the folder holds exactly the files its manifest lists, unchanged, written by
    this code for this GGUF."""
    raw = _read(folder / MANIFEST)
    try:
        manifest = json.loads(raw) if raw is not None and len(raw) < 1 << 16 else None
    except ValueError:
        return False
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != NAMES:
        return False
    for name, want in files.items():
        data = _read(folder / name)
        if data is None or hashlib.sha256(data).hexdigest() != want:
            return False
    return True


def _put(path: Path, data: bytes) -> None:
    """Write `data` to `path` unless it already holds exactly that (no symlink is followed)."""
    if path.is_file() and not path.is_symlink() and path.stat().st_size == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    write_private(path, data)
