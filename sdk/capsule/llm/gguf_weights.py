"""GGUF weights as Hugging Face tensors: the name map, dequantization, llama's q/k row order, and
an on-disk cache of the result (dequantizing a 135M model takes seconds; mapping the cache, ms).

The cache holds one safetensors file per (GGUF content sha256, dtype) in cache_dir()/gguf. It is
checked before use (format, digest, dtype, tensor names and shapes, exact size) and rebuilt when
anything is off; a cache that cannot be written only costs the dequantization next time.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ..errors import ModelLoadError, UnsupportedArchitecture
from ..paths import cache_dir, map_file, publish
from .config import ModelConfig
from .gguf_file import SUPPORTED_TYPES, GGUFHeader, TensorInfo
from .layer_weights import expected_shapes
from .safetensors_mmap import read_safetensors

if TYPE_CHECKING:
    from .linears import DenseLinears, LayerLinears
    from .q8_head import Head

CACHE_FORMAT = "capsule-gguf-cache/1"   # bump when the conversion below changes
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# GGUF layer tensor -> Hugging Face name (after blk.N. / model.layers.N.)
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.
    q_proj.weight'), None for one this decoder has no place for."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() and parts[2] in _LAYER \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def tensor_plan(header: GGUFHeader, cfg: ModelConfig) -> dict[str, TensorInfo]:
    """HF name -> GGUF tensor, every tensor's type supported and shape what `cfg` implies."""
    want, where, plan = expected_shapes(cfg), header.path.name, {}
    for t in header.tensors:
        name = hf_name(t.name)
        if name in plan:   # 'blk.03.' and 'blk.3.' would both fill layer 3
            raise ModelLoadError(f"{where}: tensors {plan[name].name!r} and {t.name!r} are both {name}")
        if name is None or name not in want:
            raise UnsupportedArchitecture(f"{where}: tensor {t.name!r} has no place in a {cfg.architecture} "
                                          f"decoder of this config; is it another architecture or variant?")
        if t.type_id not in SUPPORTED_TYPES:
            raise UnsupportedArchitecture(
                f"{where}: tensor {t.name!r} has type {t.type_name}; supported: "
                f"{', '.join(n for n, _, _ in SUPPORTED_TYPES.values())} (requantize the file to one of them)")
        if t.shape != want[name]:   # bounds what dequantizing allocates, before it does
            raise ModelLoadError(f"{where}: tensor {t.name!r} has shape {t.shape}, the metadata implies "
                                 f"{want[name]}")
        plan[name] = t
    missing = [n for n in want if n not in plan]
    if missing:
        raise ModelLoadError(f"{where}: GGUF file lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    return plan


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute (interleaved rotary pairs -> rotate-half)
    on a q or k weight (out, in) or bias (out,)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(data: np.ndarray, t: TensorInfo, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor (its bytes, shaped as GGUFReader's data) as a torch tensor of its HF shape
    in `dtype`, dequantized by gguf.quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    arr = dequantize(data, GGMLQuantizationType(t.type_id)).reshape(t.shape)   # (out, in) float32
    part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if cfg.architecture == "llama" and part in ("attn_q", "attn_k"):   # qwen2/qwen3 are not permuted
        arr = unpermute(arr, cfg.num_heads if part == "attn_q" else cfg.num_kv_heads)
    if not arr.flags.writeable:   # an F32 tensor is a view of the read-only map
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)


def tensor_bytes(header: GGUFHeader, plan: dict[str, TensorInfo]) -> dict[str, np.ndarray]:
    """Each planned tensor's bytes, a read-only view of the mapped file in GGUFReader's byte shape
    (rows, bytes per row), at the offsets read_header checked. gguf.GGUFReader is not used: it
    would parse the whole header again, seconds for a vocabulary's 100k strings."""
    buf = map_file(header.path, 24, "GGUF")   # the arrays keep it open
    if len(buf) != header.size:
        buf.close()
        raise ModelLoadError(f"{header.path} changed while it was being loaded; load it again")
    out = {}
    for name, t in plan.items():
        _, block, size = SUPPORTED_TYPES[t.type_id]
        raw = np.frombuffer(buf, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        out[name] = raw.reshape(*t.shape[:-1], t.shape[-1] // block * size)
    return out


def cache_path(digest: str, dtype: torch.dtype) -> Path:
    """The cache entry of the GGUF with sha256 ``digest`` dequantized to ``dtype``."""
    return cache_dir() / "gguf" / f"{digest}-{_ST_DTYPES[dtype].lower()}.safetensors"


def load_weights(header: GGUFHeader, cfg: ModelConfig, digest: str,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The file's weights by HF name, CPU tensors in `dtype`: mapped from the cache when it holds
    a valid entry for (digest, dtype), else dequantized (and the cache written)."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"GGUF weights load as float32, float16 or bfloat16, not {dtype}")
    plan = tensor_plan(header, cfg)
    meta = {"format": CACHE_FORMAT, "gguf_sha256": digest, "dtype": _ST_DTYPES[dtype]}
    path = cache_path(digest, dtype)
    stale = os.path.lexists(path)   # a damaged or outdated entry is replaced, a missing one only filled
    cached = _read_cache(path, meta, {n: t.shape for n, t in plan.items()}, dtype)
    if cached is not None:
        return cached
    data = tensor_bytes(header, plan)
    convert = {n: (lambda n=n: dequantize_tensor(data[n], plan[n], cfg, dtype)) for n in sorted(plan)}
    try:
        _write_cache(path, meta, plan, convert, dtype, replace=stale)
        cached = _read_cache(path, meta, {n: t.shape for n, t in plan.items()}, dtype)
    except OSError:
        cached = None   # a read-only or full cache only costs the dequantization next time
    return cached if cached is not None else {n: f() for n, f in convert.items()}


def _write_cache(path: Path, meta: dict[str, str], plan: dict[str, TensorInfo],
                 convert: dict[str, Callable[[], torch.Tensor]], dtype: torch.dtype, replace: bool) -> None:
    """Write the entry atomically: a temporary file of its own (mode 0600; two processes filling
    one entry never share it), fsynced, published at `path` (paths.publish: over what is there,
    or with replace=False only where nothing is yet), the folder fsynced. Tensor by
    tensor: safetensors.save_file would hold every tensor twice in memory."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for old in folder.glob(path.name + ".*.tmp"):   # left by a writer that died: hundreds of MB
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 3600:
                old.unlink()
    elem = torch.empty(0, dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for name in sorted(plan):
        n = elem * int(np.prod(plan[name].shape))
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(plan[name].shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)   # tensors start 8-aligned, as safetensors writes them
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for name in sorted(plan):
                f.write(convert[name]().contiguous().view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path, replace)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)   # the rename survives a power cut
    finally:
        os.close(dir_fd)


def _read_cache(path: Path, meta: dict[str, str], shapes: dict[str, tuple[int, ...]],
                dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The mapped cache entry, or None when it is missing or anything about it is off."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, 1 << 26):
                return None
            found = json.loads(f.read(n)).get("__metadata__")
        if found != meta:
            return None
        tensors = read_safetensors(path)
    except (OSError, ValueError, AttributeError, struct.error, ModelLoadError):
        return None
    if {n: tuple(t.shape) for n, t in tensors.items()} != shapes or \
            any(t.dtype != dtype for t in tensors.values()) or \
            8 + n + sum(t.numel() * t.element_size() for t in tensors.values()) != size:
        return None
    return tensors


def int4_linears(header: GGUFHeader, cfg: ModelConfig, dense: "Sequence[DenseLinears]",
                 head_weight: torch.Tensor) -> "tuple[list[LayerLinears], int, Head]":
    """The layers' linears with their Q4_0 / Q4_1 weights kept as int4 (int4_linear.int4_layers),
    how many layers that is, and the logits' head (q8_head.logits_head: Q8_0 kept as Q8_0);
    ModelLoadError when no layer is int4."""
    from .int4_linear import Q4_TYPES, int4_layers
    from .q8_head import logits_head
    plan = tensor_plan(header, cfg)
    raw, types = tensor_bytes(header, plan), {name: t.type_id for name, t in plan.items()}
    linears, n = int4_layers(cfg, dense, raw, types, unpermute if cfg.architecture == "llama" else None)
    if n == 0:
        raise ModelLoadError(f"runtime.linears='int4' keeps Q4_0 / Q4_1 weights quantized, and no layer of "
                             f"{header.path.name} has all seven projections in {' or '.join(Q4_TYPES.values())} "
                             "(with outputs a multiple of 16); use runtime.linears='dequantized'")
    name = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    return linears, n, logits_head(head_weight, raw.get(name), types.get(name))
