"""An int4-c kit's steps (torch-free): the Session's C decode step and Q8_0 head (the package's
CPU kernels, through ctypes) over the kit's tensors mapped with numpy and a numpy KV pool.

Exactness: the same C functions over the same bytes as the Session's (capsule/llm/q4_step.py,
q8_head.py), the embedding rows and RoPE rows copied as the Session indexes them, so the hidden
states and logits are the Session's bit for bit, whatever the thread count (the kernels' sums do
not depend on it). The kit is untrusted input: every tensor's shape is checked against the
kit's model before any address reaches C, every id, position, slot and block per step.
Threading: one Int4Steps per pool, called from one thread.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from edge_kernels import cpu_library
from edge_kernels.decode_step_abi import MATRICES, Layer, Mat, Step, matrix_shapes, run

from ..errors import CapsuleCorrupt, LiteUnsupported
from .kit import Kit


class Int4Steps:
    def __init__(self, kit: Kit, weights: dict[str, np.ndarray], pool: np.ndarray, threads: int):
        why = cpu_library.missing()
        if why:
            raise LiteUnsupported(f"the int4 lite restore runs the package's CPU kernels: {why}")
        m = kit.model
        if m is None:
            raise LiteUnsupported("this kit has no int4 model (it runs onnxruntime graphs)")
        self.kit, self.pool, self.threads, self.m = kit, pool, max(1, threads), m
        D, I, H, KV, hd = m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim
        self.w = weights
        self._check("embed", (kit.vocab_size, D), np.float32)
        self._check("final_norm", (D,), np.float32)
        self.rope = self.w["rope_cos"].shape[0] if "rope_cos" in self.w else 0
        self._check("rope_cos", (self.rope, hd), np.float32)
        self._check("rope_sin", (self.rope, hd), np.float32)
        self._check("head.codes", (kit.vocab_size, D), np.int8)
        self._check("head.scales", (kit.vocab_size, D // 32), np.float32)
        if D % 32 or hd % cpu_library.LANES or H > cpu_library.MAX_HEADS \
                or (kit.pool[1], kit.pool[4], kit.pool[5]) != (m.layers, KV, hd):
            raise CapsuleCorrupt(f"restore kit {kit.file.path}: its model (hidden {D}, {m.layers} layers, {H} heads, "
                                 f"{KV} x {hd} kv heads) is not one the C step runs over its pool {list(kit.pool)}")
        shapes = matrix_shapes(D, I, H, KV, hd)
        layers = []
        for i in range(m.layers):
            mats = {}
            for name in MATRICES:
                n, k = shapes[name]
                nib = self._check(f"{i}.{name}.nib", (n, k // 2), np.uint8)
                d = self._check(f"{i}.{name}.d", (n, k // 32), np.float32)
                mt = self._check(f"{i}.{name}.mt", (k // 32, n), np.float32)
                bias = None
                if (name == "qkv" and m.qkv_bias) or (name == "o" and m.o_bias):
                    bias = self._check(f"{i}.{name}.bias", (n,), np.float32).ctypes.data
                mats[name] = Mat(nib.ctypes.data, d.ctypes.data, mt.ctypes.data, bias)
            layers.append(Layer(self._check(f"{i}.in_norm", (D,), np.float32).ctypes.data,
                                self._check(f"{i}.post_norm", (D,), np.float32).ctypes.data,
                                mats["qkv"], mats["o"], mats["gate_up"], mats["down"]))
        self.layers = (Layer * len(layers))(*layers)

    def _check(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        a = self.w.get(name)
        if a is None or a.shape != shape or a.dtype != np.dtype(dtype) or not a.flags.c_contiguous:
            got = "missing" if a is None else f"{a.shape} {a.dtype}"
            raise CapsuleCorrupt(f"restore kit {self.kit.file.path}: tensor {name!r} should be {shape} "
                                 f"{np.dtype(dtype)}, is {got}; write it again (Session.write_lite_kit)")
        return a

    def step(self, rows: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]]) -> np.ndarray:
        """One token for each of the ``len(ids)`` rows (``rows``, the Session's padded batch, does
        not change a row's bits here); returns the final normed hidden states (len(ids), D)."""
        k, m = self.kit, self.m
        NB, bs = k.pool[0], k.pool[3]
        B, nb = len(ids), max(len(t) for t in tables)
        ids_a, pos = np.asarray(ids, np.int64), np.asarray(positions, np.int64)
        table = np.full((B, nb), k.scratch_block, np.int64)
        for r, t in enumerate(tables):
            table[r, :len(t)] = t
        slot = np.asarray(slots, np.int64)
        # the C step trusts these: check them against the kit's pool, rope and vocabulary
        if (ids_a.min() < 0 or ids_a.max() >= k.vocab_size or pos.min() < 0 or pos.max() >= self.rope
                or table.min() < 0 or table.max() >= NB or slot.min() < 0 or slot.max() >= NB * bs
                or np.any(pos >= nb * bs)):
            raise LiteUnsupported("a step's ids, positions, slots or blocks lie outside the kit's model or pool")
        x = np.ascontiguousarray(self.w["embed"][ids_a])                  # (B, D), as F.embedding
        cos = np.ascontiguousarray(self.w["rope_cos"][pos])               # (B, hd)
        sin = np.ascontiguousarray(self.w["rope_sin"][pos])
        lens = pos + 1
        out = np.empty((B, m.hidden), np.float32)
        strides = [s // 4 for s in self.pool.strides]
        s = Step(m.layers, m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim, m.eps, m.scale,
                 self.w["final_norm"].ctypes.data, self.pool.ctypes.data, 0, strides[0], strides[1], strides[2],
                 bs, B, nb, cos.ctypes.data, sin.ctypes.data, slot.ctypes.data, table.ctypes.data,
                 lens.ctypes.data, None)
        run(self.layers, s, x.ctypes.data, out.ctypes.data, self.threads)
        return out

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Logits (n, V) of hidden (n, D) over the Q8_0 head, as the Session's Q8Head."""
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        n, D = h.shape
        V = self.kit.vocab_size
        out = np.empty((n, V), np.float32)
        rc = cpu_library.library().capsule_q8_linear(h.ctypes.data, n, self.w["head.codes"].ctypes.data,
                                                     self.w["head.scales"].ctypes.data, V, D, out.ctypes.data,
                                                     self.threads)
        if rc != 0:
            raise RuntimeError("the CPU Q8_0 head could not start its threads")
        return out

