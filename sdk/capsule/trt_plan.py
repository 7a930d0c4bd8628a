"""TensorRT plans built from ONNX files and cached on disk, and an engine's tensors bound to
static buffers: one way for every engine here (the policy's, the LLM's), so both build with the
same flags, key their caches the same way and check their bindings alike.

A plan (serialized engine bytes, not pickle) is valid only for the TensorRT version, the GPU
(name and compute capability), the precision, the input shapes and the ONNX it came from:
``plan_key`` covers each, and ``cached_plan`` reads or builds it under cache_dir(). ``tensorrt``
is passed in by the caller (imported lazily there).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from .errors import EngineUnavailable
from .paths import write_private

PLAN_RECIPE = 1  # bump when build_plan changes what it builds (flags, profiles)


def plan_key(trt_version: str, capability: tuple[int, int], gpu: str, precision: str,
             shapes: dict[str, list[int]], digest: str) -> str:
    """Cache key of a built plan: it is only valid for exactly these."""
    blob = json.dumps({"recipe": PLAN_RECIPE, "trt": trt_version, "gpu": gpu,
                       "sm": f"{capability[0]}{capability[1]}", "precision": precision,
                       "shapes": shapes, "digest": digest}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached_plan(path: Path, build: Callable[[], bytes]) -> bytes:
    """The plan at ``path``, or ``build()`` written there first (atomically, mode 0600)."""
    if path.is_file():
        return path.read_bytes()
    plan = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, plan)
    return plan


def trt_major(trt: Any) -> int:
    return int(trt.__version__.split(".")[0])


def import_tensorrt() -> Any:
    """The tensorrt module, or EngineUnavailable saying how to install it."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise EngineUnavailable(f"tensorrt is not importable ({exc}); pip install "
                                "'exec-capsules[tensorrt]' or use JetPack's python3-libnvinfer") from None
    return trt


def bind_io(trt: Any, engine: Any, context: Any, tensors: Mapping[str, torch.Tensor],
            required: Iterable[str] = ()) -> list[str]:
    """Point every I/O tensor of ``engine`` at its buffer in ``tensors`` (by name), once: the
    buffers never move. Each one's dtype and, after the input shapes are set, shape must be the
    buffer's (TensorRT writes the volume it computes). An input no layer reads may be gone from
    the engine (TensorRT drops it); ``required`` names those that must be there. Returns the
    engine's I/O names; EngineUnavailable names a mismatch."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    lacking = sorted(set(required) - set(names))
    if lacking:
        raise EngineUnavailable(f"the TensorRT engine lacks I/O tensor(s) {lacking}; it has {sorted(names)}")
    for name in names:
        t = tensors.get(name)
        if t is None:
            raise EngineUnavailable(f"the TensorRT engine has I/O tensor {name!r}, no buffer has that name")
        want = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
        if np.dtype(str(t.dtype).removeprefix("torch.")) != want:
            raise EngineUnavailable(f"TensorRT tensor {name!r} is {want}, its buffer is {t.dtype}")
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            if not context.set_input_shape(name, tuple(t.shape)):
                raise EngineUnavailable(f"TensorRT rejected input shape {tuple(t.shape)} for {name!r}")
        context.set_tensor_address(name, t.data_ptr())
    for name in names:
        got = tuple(context.get_tensor_shape(name))
        if got != tuple(tensors[name].shape):
            raise EngineUnavailable(f"TensorRT tensor {name!r} has shape {got}, its buffer "
                                    f"{tuple(tensors[name].shape)}")
    return names


def build_plan(trt: Any, logger: Any, onnx_path: Path, precision: str) -> bytes:
    """Parse the ONNX file (its external data beside it) and build a serialized engine;
    symbolic batch dims are pinned to 1 (one optimization profile)."""
    builder = trt.Builder(logger)
    # TensorRT 10 networks are always explicit-batch; 8.x needs the flag
    flags = 0 if trt_major(trt) >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineUnavailable(f"TensorRT {trt.__version__}'s ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    if precision == "fp16":
        if not hasattr(trt.BuilderFlag, "FP16"):  # TensorRT 11: strongly typed networks only
            raise EngineUnavailable(f"TensorRT {trt.__version__} has no BuilderFlag.FP16 (networks are "
                                    "strongly typed): export in fp16 or use precision='fp32'")
        config.set_flag(trt.BuilderFlag.FP16)
    elif hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: match torch/ORT to ~1e-6
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    if any(-1 in tuple(inp.shape) for inp in inputs):  # a symbolic batch dim: one profile at 1
        profile = builder.create_optimization_profile()
        for inp in inputs:
            shape = (1, *tuple(inp.shape)[1:])
            profile.set_shape(inp.name, shape, shape, shape)
        config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise EngineUnavailable("TensorRT engine build returned nothing (set the logger to VERBOSE to see why)")
    return bytes(blob)
