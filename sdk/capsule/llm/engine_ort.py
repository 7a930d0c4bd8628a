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

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import EngineUnavailable
from .kv_pool import SCRATCH_BLOCK
from .onnx_step import INPUTS, OUTPUTS, StepShape, build_step, step_bias

_NP = {torch.float32: np.float32, torch.int64: np.int64}


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
    """ONNX Runtime steps of ``model`` over pools of its layout (CPU execution provider).

    Called as the runner's step engine (``runner.StepEngine``), shapes are bucketed so a few
    sessions serve every call: T and the block-table width are rounded up to a power of two,
    the padding tokens write to the scratch block 0 and are never attended, the padding blocks
    are the scratch block and lie past every query's position. A prefill across a memory region
    (``block_pos`` / ``segments``) runs the model's own torch step, on the same pool."""
    name = "onnxruntime"

    def __init__(self, model: Any, *, threads: int | None = None) -> None:
        why = missing_packages()
        if why is not None:   # onnx too: the step graph is built with it on the first call
            raise EngineUnavailable(why)
        import onnxruntime as ort
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise EngineUnavailable(f"the onnxruntime LLM engine runs fp32 models on CPU; this one "
                                    f"is {model.dtype} on {model.device}")
        self.model = model
        self._ort = ort
        self._threads = threads if threads is not None else torch.get_num_threads()
        self._sessions: dict[StepShape, Any] = {}
        self._weights: tuple[list[str], list[Any]] | None = None   # shared by every session

    @property
    def shapes(self) -> list[StepShape]:
        """The step shapes built so far (one ORT session each)."""
        return list(self._sessions)

    def session(self, shape: StepShape) -> Any:
        got = self._sessions.get(shape)
        if got is None:
            blob, external = build_step(self.model, shape)
            if self._weights is None:
                # OrtValues over the model's own memory (no copy), kept alive with this object
                names = list(external)
                self._weights = (names, [self._ort.OrtValue.ortvalue_from_numpy(external[n].numpy())
                                         for n in names])
            so = self._ort.SessionOptions()
            so.intra_op_num_threads = self._threads
            so.inter_op_num_threads = 1
            # prepacking would give each session its own repacked copy of every weight
            so.add_session_config_entry("session.disable_prepacking", "1")
            # idle ORT threads must not spin: they would take the cores torch's own steps (the
            # sampler, a memory-region prefill, the policy) need. Measured at 2 threads on
            # builtin:small: torch prefill 46 ms with ORT not spinning, 102 ms with it spinning
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_external_initializers(*self._weights)
            got = self._ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
            names_in = [i.name for i in got.get_inputs()]
            names_out = [o.name for o in got.get_outputs()]
            if names_in != list(INPUTS) or names_out != list(OUTPUTS):
                raise EngineUnavailable(f"ONNX step graph has inputs {names_in} and outputs "
                                        f"{names_out}, expected {list(INPUTS)} -> {list(OUTPUTS)}")
            self._sessions[shape] = got
        return got

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, kv_pool: torch.Tensor, *,
                 slot_valid: torch.Tensor | None = None, block_pos: torch.Tensor | None = None,
                 segments: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        if block_pos is not None or segments is not None:
            return self.model(input_ids, positions, slot_mapping, block_tables, kv_pool,
                              slot_valid=slot_valid, block_pos=block_pos, segments=segments)
        B, T = input_ids.shape
        tb, nbb = _pow2(T), _pow2(block_tables.shape[1])
        if tb != T:
            pad = tb - T
            input_ids = torch.cat([input_ids, input_ids.new_zeros(B, pad)], 1)
            positions = torch.cat([positions, positions[:, -1:].expand(B, pad)], 1)
            # each row's padding tokens write to the scratch block's slots (never read)
            scratch = (torch.arange(B * pad) % kv_pool.shape[3]).view(B, pad)
            slot_mapping = torch.cat([slot_mapping.view(B, T), scratch], 1).reshape(-1)
        if nbb != block_tables.shape[1]:
            block_tables = torch.cat([block_tables, block_tables.new_full(
                (B, nbb - block_tables.shape[1]), SCRATCH_BLOCK)], 1)
        hidden = self.forward(input_ids, positions, slot_mapping, block_tables, kv_pool,
                              slot_valid=slot_valid)
        return hidden[:, :T]

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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bind(bind: Any, name: str, t: torch.Tensor) -> None:
    bind(name, "cpu", 0, _NP[t.dtype], list(t.shape), t.data_ptr())
