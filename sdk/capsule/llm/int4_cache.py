"""A GGUF's int4 linears and logits head (Q8_0 or fp16), packed once and mapped from the cache on
later opens.

Packing is the int4 open's extra cost (the codes unpacked from the GGUF blocks, repacked for
the kernel, the head converted: ~0.3 s for SmolLM2, paid on every restore). The packed tensors
go into one safetensors file keyed by the GGUF's sha256, torch's version (torch's kernel packs
in its own layout), whether the package's C kernels are built (they choose the matrices and
the head) and a fingerprint of this code; a later open maps it (no bytes read until used). An entry whose key, names, shapes or dtypes are not exactly what this model needs is
ignored and written again; a cache that cannot be written only costs the packing next time.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Sequence

import torch

from edge_kernels import q4_linear_cpu, q8_linear_cpu
from edge_kernels.decode_step_abi import MATRICES

from ..errors import ModelLoadError
from ..paths import cache_dir, write_private
from . import int4_linear, q8_head
from .config import ModelConfig
from .int4_linear import HalfHead, Int4Linears, int4_layer, matrix_shapes, matrix_type
from .linears import DenseLinears, LayerLinears
from .q8_head import Head, Q8Head
from .safetensors_mmap import read_safetensors

Packer = Callable[[], "tuple[list[LayerLinears], int, Head]"]


def _key(digest: str) -> dict[str, str]:
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes()
                                   for m in (int4_linear, q8_head, q8_linear_cpu, q4_linear_cpu))
                          + Path(__file__).read_bytes()).hexdigest()
    # the matrices and head an entry holds depend on whether the C kernels were built: an entry
    # packed without them (torch's int4, fp16 head) is not reused where they are, nor the reverse
    built = "built" if q8_linear_cpu.missing() is None else "missing"
    return {"format": "capsule-int4-3", "gguf_sha256": digest, "torch": torch.__version__, "code": code,
            "cpu_kernels": built, "matrices": matrix_type().__name__}


def int4_model(cfg: ModelConfig, dense: Sequence[DenseLinears], head_weight: torch.Tensor, digest: str,
               pack: Packer) -> tuple[list[LayerLinears], int, Head]:
    """(linears per layer, how many are int4, the logits head): mapped from the cache entry of
    `digest`, else built (``pack()``) and the entry written."""
    path = entry_path(digest)
    key = _key(digest)
    stale = os.path.lexists(path)   # an outdated entry is replaced, a missing one only filled
    cached = _load(path, key, cfg, dense, head_weight)
    if cached is not None:
        return cached
    layers, n, head = pack()
    tensors = ({"head.codes": head.codes, "head.scales": head.scales} if isinstance(head, Q8Head)
               else {"head": head.weight} if isinstance(head, HalfHead) else {})
    for i, lin in enumerate(layers):
        if isinstance(lin, Int4Linears):
            for name, m in lin.matrices().items():
                tensors.update({f"{i}.{name}.{t}": v for t, v in m.tensors().items()})
    try:
        from safetensors.torch import save
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, save(tensors, metadata=key), replace=stale)
    except OSError:
        pass   # a read-only or full cache: the next open packs again
    return layers, n, head


def entry_path(digest: str) -> Path:
    """Where the cache entry of the GGUF with this sha256 lives (it may not exist)."""
    return cache_dir() / "gguf" / f"{digest}-int4.safetensors"


def _load(path: Path, key: dict[str, str], cfg: ModelConfig, dense: Sequence[DenseLinears],
          head_weight: torch.Tensor) -> tuple[list[LayerLinears], int, Head] | None:
    try:
        if _metadata(path) != key:
            return None
        tensors = read_safetensors(path)
    except (OSError, ValueError, struct.error, ModelLoadError):
        return None
    head = _head(tensors, head_weight)
    if head is None:
        return None
    mat, shapes = matrix_type(), matrix_shapes(cfg)
    layers: list[LayerLinears] = []
    for i, lin in enumerate(dense):
        found = {name: {t: tensors.pop(f"{i}.{name}.{t}", None) for t in mat.TENSORS} for name in MATRICES}
        if all(v is None for parts in found.values() for v in parts.values()):
            layers.append(lin)
            continue
        if any(v is None for parts in found.values() for v in parts.values()):
            return None
        mats = {name: mat.from_tensors(parts) for name, parts in found.items()}
        if any(m is None or (m.n_out, m.n_in) != shapes[name] for name, m in mats.items()):
            return None
        layers.append(int4_layer(cfg, lin, mats))
    if tensors:   # names this model has no place for
        return None
    return layers, sum(isinstance(x, Int4Linears) for x in layers), head


def _head(tensors: dict[str, torch.Tensor], weight: torch.Tensor) -> Head | None:
    """The entry's head, taken out of `tensors`: fp16 "head" or Q8_0 "head.codes" + "head.scales"
    (when the kernel is built), mapped, not copied; None when neither fits `weight` (V, D)."""
    half, codes, scales = (tensors.pop(n, None) for n in ("head", "head.codes", "head.scales"))
    if half is not None and codes is None and scales is None:
        ok = half.dtype == torch.float16 and half.shape == weight.shape
        return HalfHead(half) if ok else None   # already fp16: HalfHead keeps the mapped tensor
    if half is None and codes is not None and scales is not None and q8_linear_cpu.missing() is None:
        try:
            return Q8Head(codes, scales) if codes.shape == weight.shape else None
        except ValueError:
            return None
    return None


def _metadata(path: Path) -> dict[str, str] | None:
    """The entry's __metadata__, read without mapping it (a foreign entry costs nothing)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 26:
            return None
        meta = json.loads(f.read(n)).get("__metadata__")
    return meta if isinstance(meta, dict) else None
