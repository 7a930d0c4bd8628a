"""Zero-copy safetensors reading: tensors are views of a copy-on-write memory map.

Opening a model is on the restore path, so weights are not read until touched. The header
is untrusted input: every offset is bounds-checked against the file size.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..paths import map_file

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER = 100 * 2**20


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Map `path` and return name -> CPU tensor views into it (no bytes are read eagerly)."""
    path = Path(path)
    # ACCESS_COPY: writable views without touching the file, and no read-only warnings
    mapped = map_file(path, 8, "safetensors", mmap.ACCESS_COPY)
    size = len(mapped)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    if header_len > min(_MAX_HEADER, size - 8):
        raise ModelLoadError(f"{path}: header length {header_len} exceeds the file ({size} bytes)")
    try:
        header = json.loads(bytes(mapped[8:8 + header_len]))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: header is not a JSON object")
    base = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _view(path, mapped, base, size, name, meta)
    return tensors


def _view(path: Path, mapped: mmap.mmap, base: int, size: int, name: str, meta: dict) -> torch.Tensor:
    try:
        dtype = _DTYPES[meta["dtype"]]
        shape = [int(d) for d in meta["shape"]]
        start, end = (int(o) for o in meta["data_offsets"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ModelLoadError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
    numel = 1
    for d in shape:
        if d < 0:
            raise ModelLoadError(f"{path}: tensor {name!r} has a negative dimension")
        numel *= d
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if not (0 <= start <= end and end - start == nbytes and base + end <= size):
        raise ModelLoadError(f"{path}: tensor {name!r} offsets {start}..{end} do not fit its shape "
                             f"{shape} or the file")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapped, dtype=dtype, count=numel, offset=base + start).view(shape)
