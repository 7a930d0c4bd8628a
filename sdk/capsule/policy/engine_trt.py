"""tensorrt engine: a serialized TensorRT engine bound to the static buffers, in a CUDA graph.

`tensorrt` is imported lazily, so this module imports anywhere; without a CUDA device or
without the package the constructor raises EngineUnavailable and selection moves on.
The plan is built once from the ONNX file and cached under cache_dir()/policy/trt
(``capsule.trt_plan``: keyed by TensorRT version, GPU, precision, input shapes and the model
digest). Tensor addresses are set once
(set_tensor_address) to the static buffers; `hidden_out` goes to a static twin that is
copied into buffers.hidden inside the same graph. The step (execute_async_v3 + that copy) is
captured into a CUDA graph; a step is one replay on torch's current stream (the policy's own,
PolicyBuffers.stream: the runner makes it current) and allocates nothing. Not thread-safe:
the runner serializes calls. probe_tensorrt is this engine's doctor probe.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cudagraph import capture_graph
from ..errors import EngineUnavailable
from ..paths import cache_dir
from ..trt_plan import bind_io, build_plan, cached_plan, import_tensorrt, plan_key, trt_major
from .buffers import PolicyBuffers
from .probe import FAILED, MISSING, OK, TOLERANCE, Check, NeedsPackage, export_probe, max_diff
from .source import PolicySource
from .spec import ACTION, HIDDEN_IN, HIDDEN_OUT

PRECISIONS = ("fp32", "fp16")
log = logging.getLogger("capsule.policy")


class TensorRTEngine:
    name = "tensorrt"

    def __init__(self, source: PolicySource, buffers: PolicyBuffers, *, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        dev = buffers.device
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise EngineUnavailable(f"needs a CUDA device (policy device is {dev}, "
                                    f"torch.cuda.is_available() is {torch.cuda.is_available()})")
        trt = import_tensorrt()
        self.buffers = buffers
        self.hidden_next = torch.empty_like(buffers.hidden) if buffers.hidden is not None else None
        tensors = dict(buffers.obs)  # graph input names are the observation keys
        tensors[ACTION] = buffers.action
        if buffers.hidden is not None:
            tensors[HIDDEN_IN], tensors[HIDDEN_OUT] = buffers.hidden, self.hidden_next
        shapes = {k: list(t.shape) for k, t in tensors.items()}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.detail = f"TensorRT {trt.__version__} {precision}"
        # TensorRT builds, deserializes and allocates on the *current* CUDA device: make it dev's
        with torch.cuda.device(dev):
            logger = trt.Logger(trt.Logger.ERROR)
            plan = self._plan(trt, logger, source, dev, precision, shapes)
            self.engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
            if self.engine is None:
                raise EngineUnavailable("TensorRT could not deserialize the cached plan")
            self.context = self.engine.create_execution_context()
            bind_io(trt, self.engine, self.context, tensors)   # once: the buffers never move
            self._capture()

    def _plan(self, trt: Any, logger: Any, source: PolicySource, dev: torch.device, precision: str,
              shapes: dict[str, list[int]]) -> bytes:
        cap = torch.cuda.get_device_capability(dev)
        key = plan_key(trt.__version__, cap, torch.cuda.get_device_name(dev), precision, shapes,
                       source.spec.digest)
        return cached_plan(cache_dir() / "policy" / "trt" / f"{key[:32]}.plan",
                           lambda: build_plan(trt, logger, source.onnx_path(), precision))

    def _enqueue(self) -> None:
        stream = torch.cuda.current_stream(self.buffers.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 returned False")
        if self.hidden_next is not None:
            self.buffers.hidden.copy_(self.hidden_next)  # in place, same stream: (1, H) <- (1, H)

    def _capture(self) -> None:
        try:  # the warm-up enqueues run TensorRT's deferred setup outside the capture
            graph = capture_graph(self._enqueue, self.buffers.device)
        except RuntimeError as exc:  # some plans are not capturable: run them enqueue by enqueue
            log.warning("tensorrt: CUDA graph capture failed (%s); running without a graph", exc)
            self.detail += ", no CUDA graph"
            return
        self.graph = graph
        self.detail += ", CUDA graph"

    def run(self) -> None:
        # hot path: one graph replay (or one enqueue) on torch's current stream (the policy's);
        # no allocation
        if self.graph is not None:
            self.graph.replay()                  # CUDAGraph.replay guards its own device
        else:
            with torch.cuda.device(self.buffers.device):  # enqueue on the engine's device
                self._enqueue()


# -- doctor probe: an engine built for the probe Linear, run on the GPU -----------------------

def _trt_run(trt: Any, path: Path, x: np.ndarray, want: np.ndarray) -> np.ndarray:
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    # TensorRT 10 networks are always explicit-batch; 8.x needs the flag
    flags = 0 if trt_major(trt) >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"ONNX parser: {errors}")
    blob = builder.build_serialized_network(network, builder.create_builder_config())
    if blob is None:
        raise RuntimeError("engine build returned nothing (set the logger to VERBOSE to see why)")
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    context = engine.create_execution_context()
    xin = torch.from_numpy(x).cuda()
    out = torch.empty(tuple(want.shape), dtype=torch.float32, device="cuda")
    context.set_tensor_address("x", xin.data_ptr())
    context.set_tensor_address("y", out.data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("execute_async_v3 returned False")
    stream.synchronize()
    return out.cpu().numpy()


def probe_tensorrt(work: Path) -> Check:
    try:
        trt = import_tensorrt()
    except EngineUnavailable as exc:
        return Check("tensorrt", MISSING, "-", str(exc))
    if not torch.cuda.is_available():
        return Check("tensorrt", MISSING, trt.__version__, "needs a CUDA GPU; torch.cuda.is_available() is False")
    try:
        path, x, want = export_probe(work)
    except NeedsPackage as exc:
        return Check("tensorrt", MISSING, trt.__version__, f"importable, but {exc}")
    diff = max_diff(_trt_run(trt, path, x, want), want)
    if diff > TOLERANCE:
        return Check("tensorrt", FAILED, trt.__version__, f"engine output differs from torch by {diff:.1e}")
    return Check("tensorrt", OK, trt.__version__, f"built an engine for the probe Linear; matches torch "
                 f"(max diff {diff:.1e})")
