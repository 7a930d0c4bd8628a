"""A C-step kit's steps (torch-free; engines "int4-c" and "f32-c"): the Session's one-call C decode
step and its head (the package's CPU kernels, through ctypes) over the kit's tensors mapped with
numpy and a numpy KV pool.

Exactness: the same C functions over the same bytes as the Session's (capsule/llm/fused_step.py;
the Q8_0 head, q8_head.py, for int4; the fp32 head of a fused dense model), the embedding rows
and RoPE rows copied as the Session indexes them, so the hidden states and logits are the
Session's bit for bit, whatever the thread count (the kernels' sums do not depend on it). The
kit is untrusted input: every tensor's shape is checked against the kit's model before any
address reaches C, every id, position, slot and block per step.
Threading: one CSteps per pool, called from one thread.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from edge_kernels import cpu_library
from edge_kernels.decode_step_abi import (MATRICES, F32Parts, Layer, Mat, Step, f32_blocks, f32_mat, matrix_shapes,
                                          q4_mat, run)

from ..errors import CapsuleCorrupt, LiteUnsupported
from .kit import Kit, ModelShape


class CSteps:
    def __init__(self, kit: Kit, weights: dict[str, np.ndarray], pool: np.ndarray, threads: int):
        why = cpu_library.missing()
        if why:
            raise LiteUnsupported(f"the {kit.engine} lite restore runs the package's CPU kernels: {why}")
        m = kit.model
        if m is None:
            raise LiteUnsupported("this kit has no C-step model (it runs onnxruntime graphs)")
        self.kit, self.pool, self.threads, self.m = kit, pool, max(1, threads), m
        self.int4 = kit.engine == "int4-c"
        D, I, H, KV, hd = m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim
        self.w = weights
        self._check("embed", (kit.vocab_size, D), np.float32)
        self._check("final_norm", (D,), np.float32)
        self.rope = self.w["rope_cos"].shape[0] if "rope_cos" in self.w else 0
        self._check("rope_cos", (self.rope, hd), np.float32)
        self._check("rope_sin", (self.rope, hd), np.float32)
        if self.int4:
            self._check("head.codes", (kit.vocab_size, D), np.int8)
            self._check("head.scales", (kit.vocab_size, D // 32), np.float32)
        else:
            self._head = F32Parts(n=1)
            self._head.part[0] = self._check("head.weight", (kit.vocab_size, D), np.float32).ctypes.data
            self._head.rows[0] = kit.vocab_size
        if hd % cpu_library.LANES or hd > cpu_library.MAX_HEAD_DIM or H > cpu_library.MAX_HEADS \
                or (kit.pool[1], kit.pool[4], kit.pool[5]) != (m.layers, KV, hd):
            raise CapsuleCorrupt(f"restore kit {kit.file.path}: its model (hidden {D}, {m.layers} layers, {H} heads, "
                                 f"{KV} x {hd} kv heads) is not one the C step runs over its pool {list(kit.pool)}")
        shapes = matrix_shapes(D, I, H, KV, hd)
        layers = []
        for i in range(m.layers):
            mats = {}
            for name in MATRICES:
                bias = None
                if (name == "qkv" and m.qkv_bias) or (name == "o" and m.o_bias):
                    bias = self._check(f"{i}.{name}.bias", (shapes[name][0],), np.float32).ctypes.data
                mats[name] = self._matrix(f"{i}.{name}", shapes[name], bias, m)
            layers.append(Layer(self._check(f"{i}.in_norm", (D,), np.float32).ctypes.data,
                                self._check(f"{i}.post_norm", (D,), np.float32).ctypes.data,
                                mats["qkv"], mats["o"], mats["gate_up"], mats["down"]))
        self.layers = (Layer * len(layers))(*layers)

    def _matrix(self, name: str, shape: tuple[int, int], bias: int | None, m: ModelShape) -> Mat:
        n, k = shape
        if self.int4:
            if k % 32:   # the Q4 kernel reads whole 32-blocks: a model whose inputs are not cannot be int4
                raise CapsuleCorrupt(f"restore kit {self.kit.file.path}: {name} takes {k} inputs, not a multiple "
                                     "of 32 (a Q4 block); write it again (Session.write_lite_kit)")
            nib = self._check(f"{name}.nib", (n, k // 2), np.uint8)
            d = self._check(f"{name}.d", (n, k // 32), np.float32)
            mt = self._check(f"{name}.mt", (k // 32, n), np.float32)
            return q4_mat(nib.ctypes.data, d.ctypes.data, mt.ctypes.data, bias)
        layer, matrix = name.split(".")
        blocks = f32_blocks(m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim)[matrix]
        return f32_mat([(self._check(f"{layer}.{part}", (r, k), np.float32).ctypes.data, r) for part, r in blocks],
                       bias)

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
        """Logits (n, V) of hidden (n, D), as the Session's head: the Q8_0 one (int4), or the
        fp32 one in the C linear (the Decoder's fused_head)."""
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        n, D = h.shape
        V = self.kit.vocab_size
        out = np.empty((n, V), np.float32)
        lib = cpu_library.library()
        if self.int4:
            rc = lib.capsule_q8_linear(h.ctypes.data, n, self.w["head.codes"].ctypes.data,
                                       self.w["head.scales"].ctypes.data, V, D, out.ctypes.data, self.threads)
        else:
            rc = lib.capsule_f32_linear(h.ctypes.data, n, ctypes.addressof(self._head), D, out.ctypes.data,
                                        self.threads)
        if rc != 0:
            raise RuntimeError("the CPU head could not start its threads")
        return out

