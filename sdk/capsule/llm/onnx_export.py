"""The ONNX step graph written to disk with its weights, for engines that build from a file
(TensorRT needs the weights at build time; ONNX Runtime binds the model's tensors instead).

``export_step(model, shape, weights_digest=...)`` writes ``step.onnx`` and ``weights.bin``
(every weight as an initializer whose external data lies in weights.bin, 4 KiB aligned) into
cache_dir()/llm/onnx/<key>/ and returns the .onnx path; ``export_key`` covers everything the
files depend on: this recipe, the model's shape and numerics (its config fingerprint), its
weights' digest, the step shape, the opset and the graph variant. A second call with the same
key finds the files and writes nothing. The folder appears whole or not at all (built beside
it, renamed into place); files are 0600.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..paths import cache_dir
from .onnx_step import KV_OUT, OPSET, StepShape, build_step

EXPORT_RECIPE = 1    # bump when the graph build_step makes changes
ALIGN = 4096
ONNX_NAME, WEIGHTS_NAME = "step.onnx", "weights.bin"


def export_key(model: Any, shape: StepShape, weights_digest: str, kv_out: str) -> str:
    blob = json.dumps({"recipe": EXPORT_RECIPE, "config": model.cfg.fingerprint(),
                       "weights": weights_digest, "shape": asdict(shape), "opset": OPSET,
                       "kv_out": kv_out, "rope": list(model.rope_cos.shape)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def weights_sha256(model: Any) -> str:
    """A digest of the model's tensors themselves, for a model without a file digest."""
    h = hashlib.sha256()
    for name in sorted(model.w):
        t = model.w[name].detach().contiguous().cpu()
        h.update(name.encode() + str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)   # any dtype, bf16 included
    return h.hexdigest()


def export_step(model: Any, shape: StepShape, *, weights_digest: str, kv_out: str = "rows",
                root: Path | None = None) -> Path:
    """The step graph of ``shape`` with its weights on disk (see the module docstring)."""
    if kv_out not in KV_OUT:
        raise ValueError(f"kv_out must be one of {KV_OUT}, got {kv_out!r}")
    key = export_key(model, shape, weights_digest, kv_out)
    base = root if root is not None else cache_dir() / "llm" / "onnx"
    folder = base / key[:32]
    if (folder / ONNX_NAME).is_file() and (folder / WEIGHTS_NAME).is_file():
        return folder / ONNX_NAME
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".{key[:32]}."))
    try:
        _write(model, shape, kv_out, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:       # another process finished the same export first: keep its files
            if not (folder / ONNX_NAME).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / ONNX_NAME


def _write(model: Any, shape: StepShape, kv_out: str, folder: Path) -> None:
    import onnx
    from onnx import TensorProto

    blob, weights = build_step(model, shape, kv_out=kv_out)
    proto = onnx.ModelProto()
    proto.ParseFromString(blob)
    graph = proto.graph
    kept = [i for i in graph.input if i.name not in weights]
    del graph.input[:]
    graph.input.extend(kept)
    offset = 0
    fd = os.open(folder / WEIGHTS_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        for name, t in weights.items():
            data = t.contiguous().cpu().numpy()          # fp32, C order: its bytes as stored
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(data.data)
            init = graph.initializer.add()
            init.name, init.data_type = name, TensorProto.FLOAT
            init.dims.extend(t.shape)
            init.data_location = TensorProto.EXTERNAL
            for k, v in (("location", WEIGHTS_NAME), ("offset", str(offset)), ("length", str(data.nbytes))):
                entry = init.external_data.add()
                entry.key, entry.value = k, v
            offset += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(folder / ONNX_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(proto.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
