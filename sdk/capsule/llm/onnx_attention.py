"""Attention of the ONNX step over the pool's past slots plus a chunk's own new K/V.

Two forms, chosen by the step's shape (``onnx_step.build_step``):
- a chunk (T > 1): the past gathered from the pool, concatenated with the chunk's keys and
  values, transposed to heads-first and attended with two MatMuls (``attend_chunk``);
- a decode step (T = 1, ``attend_decode``): the gathered past is read as it lies, (B, S, KV*hd),
  never concatenated nor transposed. The queries go in as a block-diagonal (KV*hd, H) matrix
  (query head h's row block is its kv head's, zeros elsewhere), so one MatMul scores every head
  against every past slot; the probabilities times the past values give (H, KV*hd) of which
  each head keeps its own kv head's columns (a Gather); the new token's own key and value are a
  dot product and a scaled add. The zeros add exact zeros; only the order of the softmax sum
  differs from the chunk form's (~1e-7), and the Session's engine and ``capsule.lite`` run the
  same graph, so their bits agree.

Why: per layer the chunk form copies the gathered past three more times (Concat, then the
key and value transposes) - at 2,048 slots on SmolLM2-135M ~280 MB a token beyond the
gathers; the decode form reads it once more, in the MatMuls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class GraphOps(Protocol):
    """What the attention asks of the step's graph builder."""

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str: ...

    def shape(self, x: str, *dims: int) -> str: ...

    def const(self, value: Any, hint: str = "c") -> str: ...


@dataclass(frozen=True)
class AttnDims:
    B: int        # rows
    T: int        # tokens per row
    H: int        # query heads
    KV: int       # kv heads (query head h reads kv head h // (H // KV))
    hd: int       # head dim
    S: int        # past slots a row reads (table width * block size)

    @property
    def G(self) -> int:
        return self.H // self.KV


def attention_bias(g: GraphOps, d: AttnDims) -> str:
    """``attn_bias`` (B, 1, T, S + T) shaped as the form for ``d`` adds it to its scores, once
    per step: (B, 1, G*T, S+T) for a chunk, (B, 1, S+1) for a decode step."""
    if d.T == 1:
        return g.shape("attn_bias", d.B, 1, d.S + 1)
    return g.shape(g.op("Expand", g.shape("attn_bias", d.B, 1, 1, d.T, d.S + d.T),
                        g.const(np.array([d.B, 1, d.G, d.T, d.S + d.T], np.int64))),
                   d.B, 1, d.G * d.T, d.S + d.T)


def gather_past(g: GraphOps, flat: str, first: str, plane: int) -> str:
    """One plane (layer i's keys: 2i, its values: 2i+1) of every block in the rows' tables:
    (B, nb, bs*KV*hd), one copy. flat: the pool as (NB*2L, bs*KV*hd) rows; first: each table
    entry's first row (block * 2L)."""
    return g.op("Gather", flat, g.op("Add", first, g.const(np.array(plane, np.int64))), axis=0)


def attend_chunk(g: GraphOps, d: AttnDims, q: str, k: str, v: str, past_k: str, past_v: str,
                 bias: str, scale: str) -> str:
    """q (B, T, H, hd), k/v (B, T, KV, hd), past_k/past_v from gather_past -> (B*T, H*hd)."""
    B, T, H, KV, hd, S, G = d.B, d.T, d.H, d.KV, d.hd, d.S, d.G
    keys = g.op("Concat", g.shape(past_k, B, S, KV, hd), k, axis=1)            # (B, S+T, KV, hd)
    vals = g.op("Concat", g.shape(past_v, B, S, KV, hd), v, axis=1)
    # (B, KV, G*T, hd) queries against (B, KV, hd, S+T) keys: head h = kv * G + g
    qh = g.shape(g.op("Transpose", g.shape(q, B, T, KV, G, hd), perm=[0, 2, 3, 1, 4]), B, KV, G * T, hd)
    kt = g.op("Transpose", keys, perm=[0, 2, 3, 1])
    scores = g.op("Add", g.op("Mul", g.op("MatMul", qh, kt), scale), bias)       # (B, KV, G*T, S+T)
    att = g.op("MatMul", g.op("Softmax", scores, axis=-1),
               g.op("Transpose", vals, perm=[0, 2, 1, 3]))                      # (B, KV, G*T, hd)
    return g.shape(g.op("Transpose", g.shape(att, B, KV, G, T, hd), perm=[0, 3, 1, 2, 4]), B * T, H * hd)


def attend_decode(g: GraphOps, d: AttnDims, q: str, k: str, v: str, past_k: str, past_v: str,
                  bias: str, scale: str) -> str:
    """The T = 1 form (module docstring); same arguments and result as attend_chunk."""
    B, H, KV, hd, S, G = d.B, d.H, d.KV, d.hd, d.S, d.G
    own = np.repeat(np.eye(KV, dtype=np.float32), G, axis=0)                          # (H, KV)
    # queries block-diagonal: qbd[b, kv*hd + j, h] = q[b, h, j] if h // G == kv else 0
    qbd = g.op("Mul", g.shape(q, B, H, 1, hd), g.const(own[:, :, None]))              # (B, H, KV, hd)
    qbd = g.op("Transpose", g.shape(qbd, B, H, KV * hd), perm=[0, 2, 1])            # (B, KV*hd, H)
    past = g.op("MatMul", g.shape(past_k, B, S, KV * hd), qbd)                        # (B, S, H)
    # the new key: head h's dot product with its kv head's key
    mine = g.op("ReduceSum", g.op("Mul", g.shape(q, B, KV, G, hd), g.shape(k, B, KV, 1, hd)),
                g.const(np.array([-1], np.int64)), keepdims=1)                          # (B, KV, G, 1)
    scores = g.op("Concat", g.op("Transpose", past, perm=[0, 2, 1]), g.shape(mine, B, H, 1), axis=-1)
    probs = g.op("Softmax", g.op("Add", g.op("Mul", scores, scale), bias), axis=-1)   # (B, H, S+1)
    p_past = g.op("Slice", probs, g.const(np.array([0], np.int64)), g.const(np.array([S], np.int64)),
                  g.const(np.array([2], np.int64)))
    p_new = g.op("Slice", probs, g.const(np.array([S], np.int64)), g.const(np.array([S + 1], np.int64)),
                 g.const(np.array([2], np.int64)))                                     # (B, H, 1)
    mixed = g.op("MatMul", p_past, g.shape(past_v, B, S, KV * hd))                    # (B, H, KV*hd)
    # head h keeps row h * KV + h // G of (B, H*KV, hd)
    pick = np.array([h * KV + h // G for h in range(H)], np.int64)
    att = g.op("Gather", g.shape(mixed, B, H * KV, hd), g.const(pick), axis=1)         # (B, H, hd)
    new = g.op("Mul", g.shape(p_new, B, KV, G, 1), g.shape(v, B, KV, 1, hd))          # (B, KV, G, hd)
    return g.shape(g.op("Add", att, g.shape(new, B, H, hd)), B, H * hd)
