"""sha256 over named tensors: a builtin policy's digest (its capsule binding) and the LLM step
export's fallback weights key use the same bytes for the same weights."""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]], prefix: bytes = b"") -> str:
    """sha256 of ``prefix``, then per tensor, in the order given: "name:dtype:shape" and its bytes
    as stored (any dtype, bf16 included). The order is the caller's: sort it for a set of names."""
    h = hashlib.sha256(prefix)
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
