"""Zero-copy safetensors reading: tensors are views of a copy-on-write memory map.

Opening a model is on the restore path, so weights are not read until touched. The header
is untrusted input: every offset is bounds-checked against the file size
(``capsule.safetensors_header``, shared with the torch-free restore).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from ..paths import map_file
from ..safetensors_header import ITEMSIZE, parse_header

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Map `path` and return name -> CPU tensor views into it (no bytes are read eagerly)."""
    path = Path(path)
    # ACCESS_COPY: writable views without touching the file, and no read-only warnings
    mapped = map_file(path, 8, "safetensors", mmap.ACCESS_COPY)
    entries = parse_header(memoryview(mapped), len(mapped), path)
    tensors: dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        dtype = _DTYPES[e.dtype]
        numel = (e.end - e.start) // ITEMSIZE[e.dtype]
        tensors[name] = (torch.empty(e.shape, dtype=dtype) if numel == 0 else
                         torch.frombuffer(mapped, dtype=dtype, count=numel, offset=e.start).view(e.shape))
    return tensors
