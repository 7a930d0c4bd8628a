"""Decoder decode steps run by TensorRT engines built from the ONNX step graph (CUDA only).

``TrtStep(model)(...)`` has ``Decoder.forward``'s contract (``runner.StepEngine``). Per decode
shape (``step_io.bucket_shape`` with T = 1: in practice one per batch bucket, the runner's
graphs read the full block table) it exports the ``kv_out="rows"`` graph with its weights
(``onnx_export``), builds a plan or loads it from cache_dir()/llm/trt (``trt_plan``: keyed by
TensorRT version, GPU, precision, shapes and the export key), and sets every tensor address
once: the shape's static buffers (``step_io.StepBuffers``) and the registered KV pool, which
the engine only reads. A call copies its inputs in, enqueues the engine on torch's current
stream (``execute_async_v3``) and writes the new K/V rows into the pool with torch on the same
stream (``onnx_step.write_rows``): TensorRT cannot alias a scatter's output to its input, so
the pool's data_ptr and dirty-block tracking stay exactly the torch path's. All of it is
capturable (``capturable``): the runner's CUDA graph per batch bucket replays the enqueue.

Prefill chunks (T > 1) and steps across a memory region run the model's own torch step on the
same pool: each prefill shape would be another engine build (minutes) holding another copy of
the weights. Each decode engine holds its own copy of the weights on the GPU (TensorRT bakes
them in): for SmolLM2-135M in fp32 that is 0.54 GB per batch bucket.

Needs TensorRT >= 10 (int64 I/O tensors; the graph uses opset-17 ops every TensorRT 10 parser
handles), fp32 models. Not thread-safe: the Session's LLM lock serializes calls.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, Sequence

import torch

from ..errors import EngineUnavailable
from ..paths import cache_dir
from ..trt_plan import bind_io, build_plan, cached_plan, import_tensorrt, plan_key, trt_major
from .onnx_export import export_key, export_step, weights_sha256
from .onnx_step import StepShape, write_rows
from .step_io import StepBuffers, bucket_shape, check_pool

MIN_TRT_MAJOR = 10
log = logging.getLogger("capsule")


def tensorrt_or_why(device: torch.device) -> tuple[Any, str | None]:
    """(the tensorrt module, None), or (None, why this engine cannot run on ``device``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, (f"the tensorrt LLM engine needs a CUDA model (this one is on {device}, "
                      f"torch.cuda.is_available() is {torch.cuda.is_available()})")
    try:
        trt = import_tensorrt()
    except EngineUnavailable as exc:
        return None, str(exc)
    if trt_major(trt) < MIN_TRT_MAJOR:
        return None, (f"TensorRT {trt.__version__} is older than {MIN_TRT_MAJOR}.0, which the LLM "
                      "step graph needs (int64 I/O tensors); use JetPack 6 or later, or "
                      "runtime.llm_engines=['torch']")
    return trt, None


class TrtStep:
    """TensorRT decode steps of ``model`` (see the module docstring)."""
    name = "tensorrt"
    capturable = True

    def __init__(self, model: Any, *, weights_digest: str | None = None, precision: str = "fp32") -> None:
        trt, why = tensorrt_or_why(model.device)
        if why is not None:
            raise EngineUnavailable(why)
        if model.dtype != torch.float32 or precision != "fp32":
            raise EngineUnavailable(f"the tensorrt LLM engine runs fp32 models at fp32; this one is "
                                    f"{model.dtype}, precision {precision!r}")
        self.model, self.device, self.precision = model, model.device, precision
        self._trt = trt
        self._logger = trt.Logger(trt.Logger.ERROR)
        self._runtime = trt.Runtime(self._logger)
        self._digest = weights_digest or weights_sha256(model)
        # shape -> (engine, its context, its buffers, the pool address set)
        self._bound: dict[StepShape, tuple[Any, Any, StepBuffers, int]] = {}
        self.detail = f"TensorRT {trt.__version__} {precision}"

    @property
    def shapes(self) -> list[StepShape]:
        return list(self._bound)

    def _plan(self, shape: StepShape) -> bytes:
        trt, dev = self._trt, self.device
        onnx_path = export_step(self.model, shape, weights_digest=self._digest, kv_out="rows")
        key = plan_key(trt.__version__, torch.cuda.get_device_capability(dev),
                       torch.cuda.get_device_name(dev), self.precision, {"step": list(asdict(shape).values())},
                       export_key(self.model, shape, self._digest, "rows"))
        log.info("tensorrt: engine for step shape %s (built once, then cached)", shape)
        return cached_plan(cache_dir() / "llm" / "trt" / f"{key[:32]}.plan",
                           lambda: build_plan(trt, self._logger, onnx_path, self.precision))

    def _binding(self, shape: StepShape, kv_pool: torch.Tensor) -> tuple[Any, StepBuffers]:
        got = self._bound.get(shape)
        if got is not None and got[3] == kv_pool.data_ptr():
            return got[1], got[2]
        check_pool(kv_pool, self.device, "TensorRT")
        with torch.cuda.device(self.device):   # TensorRT builds and allocates on the current device
            if got is None:
                engine = self._runtime.deserialize_cuda_engine(self._plan(shape))
                if engine is None:
                    raise EngineUnavailable("TensorRT could not deserialize the LLM step plan")
                context = engine.create_execution_context()
                bufs = StepBuffers.allocate(shape, self.model.cfg, self.device, rows=True)
            else:
                engine, context, bufs = got[0], got[1], got[2]
            # set once: the buffers never move. TensorRT drops an input no layer reads
            # (slot_mapping: the rows graph has no scatter)
            bind_io(self._trt, engine, context, {**bufs.named(), "kv_pool": kv_pool},
                    required=("hidden", "kv_rows", "kv_pool"))
        self._bound[shape] = (engine, context, bufs, kv_pool.data_ptr())
        return context, bufs

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own LM head (torch, inside the runner's CUDA graph)."""
        return self.model.lm_head(hidden)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, kv_pool: torch.Tensor, *,
                 slot_valid: torch.Tensor | None = None, block_pos: torch.Tensor | None = None,
                 segments: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        if block_pos is not None or segments is not None or input_ids.shape[1] > 1:
            return self.model(input_ids, positions, slot_mapping, block_tables, kv_pool,
                              slot_valid=slot_valid, block_pos=block_pos, segments=segments)
        # hot path: copies into the static buffers, one enqueue, one scatter; no host sync
        context, bufs = self._binding(bucket_shape(input_ids, block_tables, kv_pool), kv_pool)
        bufs.load(input_ids, positions, slot_mapping, block_tables, slot_valid)
        if not context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 returned False")
        assert bufs.kv_rows is not None
        write_rows(kv_pool, bufs.slot_mapping, bufs.kv_rows)
        return bufs.hidden
