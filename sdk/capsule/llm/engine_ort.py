"""Decoder steps run by ONNX Runtime, reading and writing the registered KV pool in place.

``OrtStep(model)(...)`` has ``Decoder.forward``'s contract (``runner.StepEngine``) and returns
the same hidden states (within fp32 rounding: ~1e-6). The LM head runs here too
(``OrtStep.head``, one Gemm graph): a torch-free restore (``capsule.lite``) runs the same two
graphs and so picks the same greedy tokens; the sampler stays torch.
The pool is bound through IOBinding as both ``kv_pool`` and ``kv_pool_out`` (one buffer), so
ORT's ScatterND updates it in place: its data_ptr never changes, and checkpoint / restore /
rollback see the same region the torch path writes. The weights are graph inputs bound to the
model's own tensors. One ORT session per step shape (``step_io.bucket_shape``), built on first
use with its static buffers (``step_io.StepBuffers``) bound once.

CPU models run on the CPU execution provider. CUDA models run on the CUDA execution provider
(``onnxruntime-gpu``) on torch's current stream of the model's device (``user_compute_stream``)
with ORT's own CUDA graph per shape (``enable_cuda_graph``: the bound addresses never change),
so the runner does not capture torch graphs around this engine (``capturable`` is False).
ONNX Runtime's TensorRT provider is not used: the "tensorrt" engine (``engine_trt``) runs the
same graph through TensorRT itself, with its plan cache and the pool's address under our control.

Threading: one OrtStep per model and pool, called from the thread that owns the Session's
LLM lock (as Decoder.forward is). ``onnxruntime`` is imported lazily.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import EngineUnavailable
from ..lite.ort_options import session_options
from .onnx_step import HEAD_NAME, INPUTS, OUTPUTS, StepShape, build_head, build_step
from .step_io import StepBuffers, bucket_shape, check_pool, past_tables

_NP = {torch.float32: np.float32, torch.int64: np.int64}
CUDA_PROVIDER = "CUDAExecutionProvider"
log = logging.getLogger("capsule")


def missing_packages() -> str | None:
    """Why this engine cannot be built here (onnx or onnxruntime not importable), or None."""
    try:
        import onnx  # noqa: F401  - builds the step graph
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return (f"the LLM engine 'onnxruntime' needs onnx and onnxruntime ({exc}): "
                "pip install 'exec-capsules[onnx]'")
    return None


class OrtStep:
    """ONNX Runtime steps of ``model`` over pools of its layout (see the module docstring).

    A prefill across a memory region (``block_pos`` / ``segments``) runs the model's own torch
    step, on the same pool. The result is a view of the shape's static ``hidden`` buffer, valid
    until the next call of that shape (the runner reads it at once)."""
    name = "onnxruntime"
    capturable = False   # on CUDA, ORT captures its own graph per shape

    def __init__(self, model: Any, *, threads: int | None = None, cuda_graph: bool = True) -> None:
        why = missing_packages()
        if why is not None:   # onnx too: the step graph is built with it on the first call
            raise EngineUnavailable(why)
        import onnxruntime as ort
        if model.dtype != torch.float32:
            raise EngineUnavailable(f"the onnxruntime LLM engine runs fp32 models; this one is "
                                    f"{model.dtype} (runtime.dtype='float32')")
        self.device = model.device
        if self.device.type == "cuda" and CUDA_PROVIDER not in ort.get_available_providers():
            raise EngineUnavailable(f"onnxruntime {ort.__version__} has no {CUDA_PROVIDER} "
                                    f"(providers: {ort.get_available_providers()}): pip install "
                                    "onnxruntime-gpu for a CUDA model")
        if self.device.type not in ("cpu", "cuda"):
            raise EngineUnavailable(f"the onnxruntime LLM engine runs on cpu or cuda, not {self.device}")
        self.model = model
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self._ort = ort
        self._threads = threads if threads is not None else torch.get_num_threads()
        # shape -> (session, its IOBinding, its buffers, the pool address bound)
        self._bound: dict[StepShape, tuple[Any, Any, StepBuffers, int]] = {}
        # rows -> (head session, its IOBinding, hidden buffer (rows, D), logits buffer (rows, V))
        self._heads: dict[int, tuple[Any, Any, torch.Tensor, torch.Tensor]] = {}

    @property
    def threads(self) -> int:
        """ORT's intra-op threads for every session of this engine."""
        return self._threads

    @property
    def ort_version(self) -> str:
        return self._ort.__version__

    @property
    def shapes(self) -> list[StepShape]:
        """The step shapes built so far (one ORT session each)."""
        return list(self._bound)

    def _providers(self, cuda_graph: bool) -> list[Any]:
        if self.device.type == "cpu":
            return ["CPUExecutionProvider"]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        return [(CUDA_PROVIDER, {"device_id": str(self.device.index or 0),
                                 "user_compute_stream": str(stream),
                                 "enable_cuda_graph": "1" if cuda_graph else "0"})]

    def _options(self) -> Any:
        return session_options(self._ort, self._threads, cpu=self.device.type == "cpu")

    def session(self, shape: StepShape) -> Any:
        blob, weights = build_step(self.model, shape)
        so = self._options()
        try:
            sess = self._ort.InferenceSession(blob, so, providers=self._providers(self.cuda_graph))
        except Exception as exc:   # noqa: BLE001 - ORT raises its own untyped errors
            if not self.cuda_graph:
                raise EngineUnavailable(f"onnxruntime could not load the LLM step graph: {exc}") from None
            # ORT's CUDA graph needs every node on the CUDA provider; run without it
            log.warning("onnxruntime: no CUDA graph for the LLM step (%s); running without", exc)
            self.cuda_graph = False
            sess = self._ort.InferenceSession(blob, so, providers=self._providers(False))
        names_in = [i.name for i in sess.get_inputs()]
        names_out = [o.name for o in sess.get_outputs()]
        if names_in != [*INPUTS, *weights] or names_out != list(OUTPUTS):
            raise EngineUnavailable(f"ONNX step graph has inputs {names_in[:len(INPUTS)]}... and "
                                    f"outputs {names_out}, expected {list(INPUTS)}... -> {list(OUTPUTS)}")
        return sess, weights

    def _binding(self, shape: StepShape, kv_pool: torch.Tensor) -> tuple[Any, Any, StepBuffers]:
        got = self._bound.get(shape)
        if got is not None and got[3] == kv_pool.data_ptr():
            return got[0], got[1], got[2]
        check_pool(kv_pool, self.device, "ONNX Runtime")
        if got is not None and self.cuda_graph:
            got = None   # ORT's captured graph holds the old pool's address: a new session
        if got is None:
            sess, weights = self.session(shape)
            bufs = StepBuffers.allocate(shape, self.model.cfg, self.device, rows=False)
            io = sess.io_binding()
            for name, t in weights.items():     # the model's own tensors, bound once
                self._bind(io.bind_input, name, t)
            for name, t in bufs.named().items():
                self._bind(io.bind_output if name == "hidden" else io.bind_input, name, t)
        else:   # another pool than the one bound (a test's): rebind it
            sess, io, bufs = got[0], got[1], got[2]
        self._bind(io.bind_input, "kv_pool", kv_pool)
        self._bind(io.bind_output, "kv_pool_out", kv_pool)   # the same buffer: ScatterND in place
        self._bound[shape] = (sess, io, bufs, kv_pool.data_ptr())
        return sess, io, bufs

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, kv_pool: torch.Tensor, *,
                 slot_valid: torch.Tensor | None = None, block_pos: torch.Tensor | None = None,
                 segments: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """input_ids, positions: (B, T); slot_mapping: (B*T,); block_tables: (B, nb);
        kv_pool: (NB, L, 2, bs, KV, hd) fp32, contiguous (written in place). Returns (B, T, D)."""
        if block_pos is not None or segments is not None:
            return self.model(input_ids, positions, slot_mapping, block_tables, kv_pool,
                              slot_valid=slot_valid, block_pos=block_pos, segments=segments)
        if input_ids.shape[1] > 1:    # a prefill chunk: only the blocks before it are read
            block_tables = past_tables(positions, block_tables, kv_pool.shape[3])
        sess, io, bufs = self._binding(bucket_shape(input_ids, block_tables, kv_pool), kv_pool)
        bufs.load(input_ids, positions, slot_mapping, block_tables, slot_valid)
        sess.run_with_iobinding(io)
        return bufs.hidden[:, :input_ids.shape[1]]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, D) -> logits (n, V) through ``build_head``'s graph: one ORT session per n,
        bound once to its own buffers (no CUDA graph: n varies between prefill and decode). The
        result is n's logits buffer, valid until the next call with n rows."""
        n = hidden.shape[0]
        got = self._heads.get(n)
        if got is None:
            blob, weights = build_head(self.model, n)
            try:
                sess = self._ort.InferenceSession(blob, self._options(), providers=self._providers(False))
            except Exception as exc:   # noqa: BLE001 - ORT raises its own untyped errors
                raise EngineUnavailable(f"onnxruntime could not load the LM head graph: {exc}") from None
            V, D = weights[HEAD_NAME].shape
            inp = torch.zeros(n, D, dtype=torch.float32, device=self.device)
            out = torch.zeros(n, V, dtype=torch.float32, device=self.device)
            io = sess.io_binding()
            self._bind(io.bind_input, HEAD_NAME, weights[HEAD_NAME])
            self._bind(io.bind_input, "hidden", inp)
            self._bind(io.bind_output, "logits", out)
            got = self._heads[n] = (sess, io, inp, out)
        sess, io, inp, out = got
        inp.copy_(hidden)      # on CUDA, ORT runs on torch's current stream: ordered after the copy
        sess.run_with_iobinding(io)
        return out

    def _bind(self, bind: Any, name: str, t: torch.Tensor) -> None:
        bind(name, self.device.type, self.device.index or 0, _NP[t.dtype], list(t.shape), t.data_ptr())
