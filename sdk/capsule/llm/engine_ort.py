"""Decoder steps run by ONNX Runtime, reading and writing the registered KV pool in place.

``OrtStep(model).forward(...)`` has ``Decoder.forward``'s contract for full block tables (no
skipped memory-region blocks, no query segments) and returns the same hidden states (within
fp32 rounding: ~1e-6); the sampler and the LM head stay torch. The pool is bound through
IOBinding as both ``kv_pool`` and ``kv_pool_out`` (one buffer), so ORT's ScatterND updates it
in place: its data_ptr never changes, and checkpoint / restore / rollback see the same region
the torch path writes. One ORT session per step shape (B, T, block-table width), built from
``onnx_step.build_step`` on first use and kept.

Threading: one OrtStep per model and pool, called from the thread that owns the Session's
LLM lock (as Decoder.forward is). ``onnxruntime`` is imported lazily.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import EngineUnavailable
from .onnx_step import INPUTS, OUTPUTS, StepShape, build_step, step_bias

_NP = {torch.float32: np.float32, torch.int64: np.int64}


class OrtStep:
    """ONNX Runtime steps of ``model`` over pools of its layout (CPU execution provider)."""

    def __init__(self, model: Any, *, threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EngineUnavailable("the onnxruntime LLM engine needs onnxruntime and onnx: "
                                    "pip install 'exec-capsules[onnx]'") from exc
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise EngineUnavailable(f"the onnxruntime LLM engine runs fp32 models on CPU; this one "
                                    f"is {model.dtype} on {model.device}")
        self.model = model
        self._ort = ort
        self._threads = threads if threads is not None else torch.get_num_threads()
        self._sessions: dict[StepShape, Any] = {}

    @property
    def shapes(self) -> list[StepShape]:
        """The step shapes built so far (one ORT session each)."""
        return list(self._sessions)

    def session(self, shape: StepShape) -> Any:
        got = self._sessions.get(shape)
        if got is None:
            so = self._ort.SessionOptions()
            so.intra_op_num_threads = self._threads
            so.inter_op_num_threads = 1
            got = self._ort.InferenceSession(build_step(self.model, shape), so,
                                             providers=["CPUExecutionProvider"])
            names_in = [i.name for i in got.get_inputs()]
            names_out = [o.name for o in got.get_outputs()]
            if names_in != list(INPUTS) or names_out != list(OUTPUTS):
                raise EngineUnavailable(f"ONNX step graph has inputs {names_in} and outputs "
                                        f"{names_out}, expected {list(INPUTS)} -> {list(OUTPUTS)}")
            self._sessions[shape] = got
        return got

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, kv_pool: torch.Tensor, *,
                slot_valid: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (B, T); slot_mapping: (B*T,); block_tables: (B, nb);
        kv_pool: (NB, L, 2, bs, KV, hd) fp32, contiguous (written in place). Returns (B, T, D)."""
        B, T = input_ids.shape
        NB, bs = kv_pool.shape[0], kv_pool.shape[3]
        nb = block_tables.shape[1]
        if kv_pool.dtype != torch.float32 or not kv_pool.is_contiguous():
            raise ValueError(f"the ORT step writes a contiguous fp32 pool in place, got "
                             f"{kv_pool.dtype}{'' if kv_pool.is_contiguous() else ', strided'}")
        key_valid = None if slot_valid is None else slot_valid[block_tables].view(B, -1)
        feeds = {"input_ids": input_ids.to(torch.int64).contiguous(),
                 "positions": positions.to(torch.int64).contiguous(),
                 "slot_mapping": slot_mapping.to(torch.int64).contiguous(),
                 "block_tables": block_tables.to(torch.int64).contiguous(),
                 "attn_bias": step_bias(positions, nb * bs, key_valid).contiguous()}
        hidden = torch.empty(B, T, self.model.cfg.hidden_size, dtype=torch.float32)
        sess = self.session(StepShape(B, T, nb, NB, bs))
        io = sess.io_binding()
        for name, t in feeds.items():
            _bind(io.bind_input, name, t)
        _bind(io.bind_input, "kv_pool", kv_pool)
        _bind(io.bind_output, "hidden", hidden)
        _bind(io.bind_output, "kv_pool_out", kv_pool)     # the same buffer: ScatterND in place
        sess.run_with_iobinding(io)
        return hidden


def _bind(bind: Any, name: str, t: torch.Tensor) -> None:
    bind(name, "cpu", 0, _NP[t.dtype], list(t.shape), t.data_ptr())
