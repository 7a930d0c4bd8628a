"""The ONNX step graph written to disk with its weights, for engines that build from a file
(TensorRT needs the weights at build time; ONNX Runtime binds the model's tensors instead).

``export_step(model, shape, weights_digest=...)`` returns the path of a ``step-<key>.onnx``
whose weights are initializers with their external data in ``weights.bin`` beside it (4 KiB
aligned, in the order ``build_step`` names them, which is the same for every shape of a model).
Both live in cache_dir()/llm/onnx/<model key>/: one weights file per model (its config
fingerprint, weights digest and RoPE table size), one small graph per step shape. The keys
cover everything the files depend on (``export_key``): a second call finds them and writes
nothing. weights.bin is built beside its name and renamed into place only when whole (its size
is checked before use); graphs are written atomically; files are 0600, folders 0700.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..digests import tensors_sha256
from ..paths import cache_dir, write_private
from .onnx_step import KV_OUT, OPSET, StepShape, build_step

EXPORT_RECIPE = 1    # bump when the graph build_step makes changes
ALIGN = 4096
WEIGHTS_NAME = "weights.bin"


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def model_key(model: Any, weights_digest: str) -> str:
    return _digest({"recipe": EXPORT_RECIPE, "config": model.cfg.fingerprint(),
                    "weights": weights_digest, "rope": list(model.rope_cos.shape)})


def export_key(model: Any, shape: StepShape, weights_digest: str, kv_out: str) -> str:
    return _digest({"model": model_key(model, weights_digest), "shape": asdict(shape),
                    "opset": OPSET, "kv_out": kv_out})


def weights_sha256(model: Any) -> str:
    """A digest of the model's tensors themselves, for a model without a file digest."""
    return tensors_sha256(sorted(model.w.items()))


def _layout(weights: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[int, int]], int]:
    """Each weight's (offset, length) in weights.bin, and the file's size."""
    at, offset = {}, 0
    for name, t in weights.items():
        offset += -offset % ALIGN
        at[name] = (offset, t.numel() * t.element_size())
        offset += at[name][1]
    return at, offset


def export_step(model: Any, shape: StepShape, *, weights_digest: str, kv_out: str = "rows",
                root: Path | None = None) -> Path:
    """The step graph of ``shape`` with its weights on disk (see the module docstring)."""
    if kv_out not in KV_OUT:
        raise ValueError(f"kv_out must be one of {KV_OUT}, got {kv_out!r}")
    folder = (root if root is not None else cache_dir() / "llm" / "onnx") / model_key(model, weights_digest)[:32]
    path = folder / f"step-{export_key(model, shape, weights_digest, kv_out)[:32]}.onnx"
    blob, weights = build_step(model, shape, kv_out=kv_out)
    at, size = _layout(weights)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    wpath = folder / WEIGHTS_NAME
    if not (wpath.is_file() and not wpath.is_symlink() and wpath.stat().st_size == size):
        _write_weights(wpath, weights, at)
    if not path.is_file():
        write_private(path, _with_initializers(blob, weights, at))
    return path


def _write_weights(path: Path, weights: dict[str, torch.Tensor], at: dict[str, tuple[int, int]]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for name, t in weights.items():
                data = t.contiguous().cpu().numpy()          # fp32, C order: its bytes as stored
                f.seek(at[name][0])
                f.write(data.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _with_initializers(blob: bytes, weights: dict[str, torch.Tensor], at: dict[str, tuple[int, int]]) -> bytes:
    """The graph with its weight inputs turned into initializers stored in weights.bin."""
    import onnx
    from onnx import TensorProto

    proto = onnx.ModelProto()
    proto.ParseFromString(blob)
    graph = proto.graph
    kept = [i for i in graph.input if i.name not in weights]
    del graph.input[:]
    graph.input.extend(kept)
    for name, t in weights.items():
        init = graph.initializer.add()
        init.name, init.data_type = name, TensorProto.FLOAT
        init.dims.extend(t.shape)
        init.data_location = TensorProto.EXTERNAL
        offset, length = at[name]
        for k, v in (("location", WEIGHTS_NAME), ("offset", str(offset)), ("length", str(length))):
            entry = init.external_data.add()
            entry.key, entry.value = k, v
    return proto.SerializeToString()
