"""A safetensors file's header, parsed and bounds-checked without torch.

Used by the model loader (``llm.safetensors_mmap``, torch views) and by the torch-free restore
(``capsule.lite``, numpy views). The header is untrusted input: its length, every entry's dtype,
shape and offsets are checked against the file's size before anything is viewed.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1}
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the file: bytes [start, end) from the file's first byte."""
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def parse_header(data: bytes | memoryview, size: int, path: Path) -> dict[str, Entry]:
    """The entries of a file of ``size`` bytes whose first bytes are ``data`` (at least its
    8-byte length and the header); ModelLoadError naming the file and what is off."""
    if size < 8 or len(data) < 8:
        raise ModelLoadError(f"{path} is not a safetensors file ({size} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if header_len > min(MAX_HEADER, size - 8) or len(data) < 8 + header_len:
        raise ModelLoadError(f"{path}: header length {header_len} exceeds the file ({size} bytes)")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: header is not a JSON object")
    base = 8 + header_len
    return {name: _entry(path, base, size, name, meta) for name, meta in header.items()
            if name != "__metadata__"}


def header_bytes(path: Path) -> tuple[bytes, int]:
    """(the file's length field and header, the file's size), read without mapping the file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = f.seek(0, 2)
            if len(head) < 8:
                raise ModelLoadError(f"{path} is not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise ModelLoadError(f"{path}: header length {n} exceeds the file ({size} bytes)")
            f.seek(8)
            return head + f.read(n), size
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None


def _entry(path: Path, base: int, size: int, name: str, meta: object) -> Entry:
    try:
        dtype = meta["dtype"]                                       # type: ignore[index]
        shape = tuple(int(d) for d in meta["shape"])                # type: ignore[index]
        start, end = (int(o) for o in meta["data_offsets"])         # type: ignore[index]
        itemsize = ITEMSIZE[dtype]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ModelLoadError(f"{path}: tensor {name!r} has a malformed header entry {str(meta)[:80]}") from None
    numel = 1
    for d in shape:
        if d < 0:
            raise ModelLoadError(f"{path}: tensor {name!r} has a negative dimension")
        numel *= d
    if not (0 <= start <= end and end - start == numel * itemsize and base + end <= size):
        raise ModelLoadError(f"{path}: tensor {name!r} offsets {start}..{end} do not fit its shape "
                             f"{list(shape)} or the file")
    return Entry(dtype, shape, base + start, base + end)
