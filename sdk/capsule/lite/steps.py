"""A kit's ONNX graphs run by ONNX Runtime over a numpy KV pool (torch-free).

The same graphs, the same weights, the same inputs as the Session's onnxruntime engine
(``llm/engine_ort.OrtStep``), built the same way as its ``StepBuffers`` fill them: so the hidden
states and the logits are the Session's, bit for bit, and so are the greedy tokens. One ORT
session per (rows, block-table width), built on first use or ahead of it (``Sessions.start``), its
buffers bound once; the pool is bound as both ``kv_pool`` and ``kv_pool_out`` (ScatterND writes
the new K/V in place).
Threading: one LiteSteps per pool, called from one thread; a Sessions builds on its own threads.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..errors import LiteUnsupported
from .kit import Kit
from .ort_options import session_options


class Sessions:
    """ORT sessions of a kit's graphs. ``start(name)`` builds one on a background thread:
    ONNX Runtime releases the GIL while it builds (~55-70 ms for a SmolLM2 step graph), so the
    first step's session is ready when the capsule's pages have been read; ``get(name)`` waits
    for it, or builds it here."""

    def __init__(self, kit: Kit, threads: int):
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
        self._ort, self.kit, self.threads = ort, kit, threads
        self._early: dict[str, _Build] = {}

    def start(self, name: str) -> None:
        """Build ``name``'s session in the background (once; an unknown name is left to get)."""
        if name not in self._early and self.kit.file.has(name):
            self._early[name] = _Build(self._build, name)

    def get(self, name: str) -> Any:
        early = self._early.pop(name, None)
        return early.result() if early is not None else self._build(name)

    def _build(self, name: str) -> Any:
        so = session_options(self._ort, self.threads, cpu=True)
        graph = bytes(self.kit.file.blob(name))      # CapsuleCorrupt for a damaged blob
        try:
            return self._ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
        except Exception as exc:   # noqa: BLE001 - ORT raises its own untyped errors
            raise LiteUnsupported(f"onnxruntime could not load the kit's {name!r} ({exc}); write the "
                                  "kit again with this onnxruntime") from None


class _Build:
    """One call on a daemon thread (a process may exit before it ends), its result or error kept."""

    def __init__(self, fn: Any, arg: str):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, arg), daemon=True,
                                        name="capsule-lite-build")
        self._thread.start()

    def _run(self, fn: Any, arg: str) -> None:
        try:
            self._result = fn(arg)
        except BaseException as exc:    # noqa: BLE001 - handed to result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class LiteSteps:
    def __init__(self, kit: Kit, weights: dict[str, np.ndarray], pool: np.ndarray, sessions: Sessions):
        self.kit, self.weights, self.pool, self.sessions = kit, weights, pool, sessions
        self._steps: dict[tuple[int, int], tuple[Any, Any, dict[str, np.ndarray]]] = {}
        self._heads: dict[int, tuple[Any, Any, np.ndarray, np.ndarray]] = {}

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
            sess = self.sessions.get(step_name(rows, width))
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
            sess = self.sessions.get(f"head/{n}")
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


def step_name(rows: int, width: int) -> str:
    """The kit's blob of the step graph for ``rows`` rows over tables ``width`` blocks wide."""
    return f"step/{rows}/{width}"


def _bind(bind: Any, name: str, a: np.ndarray) -> None:
    bind(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
