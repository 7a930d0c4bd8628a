"""A kit's ONNX graphs run by ONNX Runtime over a numpy KV pool (torch-free).

The same graphs, the same weights, the same inputs as the Session's onnxruntime engine
(``llm/engine_ort.OrtStep``), built the same way as its ``StepBuffers`` fill them: so the hidden
states and the logits are the Session's, bit for bit, and so are the greedy tokens. One ORT
session per (rows, block-table width), built on first use, its buffers bound once; the pool is
bound as both ``kv_pool`` and ``kv_pool_out`` (ScatterND writes the new K/V in place).
Threading: one LiteSteps per pool, called from one thread.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import LiteUnsupported
from .kit import Kit
from .ort_options import session_options


class LiteSteps:
    def __init__(self, kit: Kit, weights: dict[str, np.ndarray], pool: np.ndarray, threads: int):
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise LiteUnsupported(f"the lite restore runs onnxruntime ({exc}): pip install "
                                  "'exec-capsules[onnx]'") from None
        if ort.__version__ != kit.onnxruntime:
            # another version may compute other bits: the tokens would not be the Session's
            raise LiteUnsupported(f"the restore kit was written with onnxruntime {kit.onnxruntime}, this "
                                  f"process has {ort.__version__}: write the kit again with this one "
                                  "(Session.write_lite_kit)")
        self._ort, self.kit, self.weights, self.pool = ort, kit, weights, pool
        self.threads = threads
        self._steps: dict[tuple[int, int], tuple[Any, Any, dict[str, np.ndarray]]] = {}
        self._heads: dict[int, tuple[Any, Any, np.ndarray, np.ndarray]] = {}

    def _session(self, blob_name: str) -> Any:
        so = session_options(self._ort, self.threads, cpu=True)
        graph = bytes(self.kit.file.blob(blob_name))      # CapsuleCorrupt for a damaged blob
        try:
            return self._ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
        except Exception as exc:   # noqa: BLE001 - ORT raises its own untyped errors
            raise LiteUnsupported(f"onnxruntime could not load the kit's {blob_name!r} ({exc}); write the "
                                  "kit again with this onnxruntime") from None

    def _bind_weights(self, sess: Any, io: Any) -> None:
        for inp in sess.get_inputs():
            w = self.weights.get(inp.name)
            if w is not None:
                _bind(io.bind_input, inp.name, w)

    def step(self, rows: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]]) -> np.ndarray:
        """One token for each of ``len(ids)`` rows, padded to ``rows`` as the runner pads a
        batch; returns the hidden states (rows, D) (a view of the shape's buffer)."""
        k, bs, scratch = self.kit, self.kit.pool[3], self.kit.scratch_block
        nb = max(len(t) for t in tables)
        width = k.table_buckets[nb - 1]
        got = self._steps.get((rows, width))
        if got is None:
            sess = self._session(f"step/{rows}/{width}")
            bufs = {"input_ids": np.zeros((rows, 1), np.int64), "positions": np.zeros((rows, 1), np.int64),
                    "slot_mapping": np.zeros(rows, np.int64),
                    "block_tables": np.zeros((rows, width), np.int64),
                    "attn_bias": np.zeros((rows, 1, 1, width * bs + 1), np.float32),
                    "hidden": np.zeros((rows, 1, k.hidden_size), np.float32)}
            io = sess.io_binding()
            self._bind_weights(sess, io)
            for name, buf in bufs.items():
                _bind(io.bind_output if name == "hidden" else io.bind_input, name, buf)
            _bind(io.bind_input, "kv_pool", self.pool)
            _bind(io.bind_output, "kv_pool_out", self.pool)
            got = self._steps[(rows, width)] = (sess, io, bufs)
        sess, io, b = got
        # padding rows as the runner's: token 0 at position 0, written to the scratch block
        b["input_ids"][:] = 0
        b["positions"][:] = 0
        b["slot_mapping"][:] = scratch * bs
        b["block_tables"][:] = scratch
        for r, (t, p, s, table) in enumerate(zip(ids, positions, slots, tables)):
            b["input_ids"][r, 0], b["positions"][r, 0], b["slot_mapping"][r] = t, p, s
            b["block_tables"][r, :len(table)] = table
        # attn_bias (rows, 1, 1, S + 1): past slot s is seen when s < position (every slot of
        # the table is valid: the lite restore takes no stream with memory holes); the new token
        # sees itself (``onnx_step.step_bias``)
        seen = np.arange(width * bs)[None, :] < b["positions"][:, :1]                  # (rows, S)
        b["attn_bias"][:, 0, 0, :-1] = np.where(seen, np.float32(0), np.float32(-np.inf))
        b["attn_bias"][:, 0, 0, -1] = 0
        sess.run_with_iobinding(io)
        return b["hidden"][:, 0]

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Logits (n, V) of hidden (n, D) through the kit's head graph for n rows."""
        n = hidden.shape[0]
        got = self._heads.get(n)
        if got is None:
            sess = self._session(f"head/{n}")
            inp = np.zeros((n, self.kit.hidden_size), np.float32)
            out = np.zeros((n, self.kit.vocab_size), np.float32)
            io = sess.io_binding()
            self._bind_weights(sess, io)
            _bind(io.bind_input, "hidden", inp)
            _bind(io.bind_output, "logits", out)
            got = self._heads[n] = (sess, io, inp, out)
        sess, io, inp, out = got
        inp[:] = hidden
        sess.run_with_iobinding(io)
        return out


def _bind(bind: Any, name: str, a: np.ndarray) -> None:
    bind(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
