"""The decoder's step as an ONNX graph that writes its K/V into the pool it is given.

One graph per shape (B rows of T tokens, block tables nb wide, the pool's NB blocks): decode is
T = 1, a prefill chunk T > 1. Inputs: ``input_ids`` and ``positions`` (B, T) int64,
``slot_mapping`` (B*T,) int64 (slot = block * bs + offset, as ``write_kv`` takes it),
``block_tables`` (B, nb) int64, ``attn_bias`` (B, 1, T, S + T) fp32 (0 or -inf: which past slots
and which of the chunk's own tokens each query sees; S = nb * bs) and ``kv_pool`` (NB, L, 2, bs,
KV, hd), the pool the capsules checkpoint. Outputs: ``hidden`` (B, T, D), the final normed
hidden states (``Decoder.forward``'s result), and ``kv_pool_out``.

Why the K/V are written last: every layer attends over the pool's past slots (gathered through
the block tables) plus the chunk's own new keys (``onnx_attention``), and one ScatterND at the end
writes all layers' new K/V. Its pool input then has no reader after it, so with ``kv_pool`` and
``kv_pool_out`` bound to one buffer (IOBinding) ONNX Runtime updates the pool in place: no copy,
the same data_ptr every step, and the dirty-block tracking of the torch path stays exact. (A
per-layer write would feed the next layer's reads, and torch.onnx's exporter silently drops an
in-place ``index_copy_`` on an input: the graph is built here, op by op, from the weights.)

Weights are not copied into the graph: each is a graph input named after its Hugging Face
name (after the step inputs, in ``weights`` order), bound through IOBinding to the model's own
tensors, on the CPU or the GPU, so every step shape shares one copy, the model's. (Measured on
SmolLM2-135M, one thread: as fast per step as external initializers, bit-identical, and a
session builds in 0.13 s instead of 0.51 s; ONNX Runtime's CUDA provider would copy
initializers onto the GPU once per session.) ``onnx_export`` turns them into initializers in a
file for TensorRT, which needs weights at build time.

``kv_out="rows"`` replaces the ScatterND with an output ``kv_rows`` (2 * L * B * T, KV, hd):
the new K/V in the ScatterND's order (layer-major, keys then values, tokens in slot_mapping
order), which the caller writes into the pool (``write_rows``). TensorRT cannot alias an
output to an input for a scatter (only its KVCacheUpdate layer over a linear cache does), so
its engine reads the pool and leaves the write to torch, on the same stream.

The math is ``Decoder.forward``'s: RMSNorm in fp32, rotate-half RoPE from the same tables, GQA
(query head h reads kv head h // G), SwiGLU, optional QKV / o biases and Qwen3's q/k norms. The
past-plus-new order of the keys changes only the order of a softmax sum (~1e-7).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .onnx_attention import AttnDims, attend_chunk, attend_decode, attention_bias, gather_past

OPSET = 17
INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "attn_bias", "kv_pool")
OUTPUTS = ("hidden", "kv_pool_out")
ROW_OUTPUTS = ("hidden", "kv_rows")          # kv_out="rows"
KV_OUT = ("pool", "rows")


@dataclass(frozen=True)
class StepShape:
    batch: int          # B rows
    tokens: int         # T tokens per row (1: decode)
    table_blocks: int   # nb: block-table width
    pool_blocks: int    # NB: blocks in the pool
    block_size: int     # bs


class _Builder:
    """Nodes and initializers of one graph; every value gets a fresh name."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper
        self._helper, self._np = helper, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.weights: dict[str, torch.Tensor] = {}
        self._n = 0

    def weight(self, name: str, t: torch.Tensor) -> str:
        """A weight the graph takes as an input named ``name`` (bound to the model's own tensor)."""
        if name not in self.weights:
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name}: the ONNX step takes contiguous fp32 weights")
            self.weights[name] = t.detach()
        return name

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value: Any, hint: str = "c") -> str:
        arr = np.asarray(value)
        n = self.name(hint)
        self.inits.append(self._np.from_array(arr, n))
        return n

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        o = out or self.name(op_type.lower())
        self.nodes.append(self._helper.make_node(op_type, list(inputs), [o], **attrs))
        return o

    def shape(self, x: str, *dims: int) -> str:
        return self.op("Reshape", x, self.const(np.array(dims, dtype=np.int64), "shape"))


def _rms(g: _Builder, x: str, w: str, eps: float) -> str:
    var = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(np.float32(eps)))))
    return g.op("Mul", w, g.op("Mul", x, inv))


def _linear(g: _Builder, x: str, n: int, w: str, b: str | None) -> str:
    """x (n, in) @ w.T (+ b): the torch (out, in) weight as is (Gemm transB)."""
    return g.op("Gemm", x, w, *([b] if b else []), transB=1)


def _rope(g: _Builder, x: str, cos: str, sin: str, hd: int) -> str:
    """x (B, T, heads, hd) rotated by cos/sin (B, T, 1, hd): x * cos + rotate_half(x) * sin."""
    half = hd // 2
    lo = g.op("Slice", x, g.const(np.array([0], np.int64)), g.const(np.array([half], np.int64)),
              g.const(np.array([3], np.int64)))
    hi = g.op("Slice", x, g.const(np.array([half], np.int64)), g.const(np.array([hd], np.int64)),
              g.const(np.array([3], np.int64)))
    rot = g.op("Concat", g.op("Neg", hi), lo, axis=3)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))


def build_step(model: Any, shape: StepShape, *, kv_out: str = "pool"
               ) -> tuple[bytes, dict[str, torch.Tensor]]:
    """One step of ``model`` (a ``capsule.llm.model.Decoder``): (the serialized ONNX graph,
    the weights it takes as inputs after ``INPUTS``, in order, each the model's own tensor).
    kv_out: "pool" (ScatterND into ``kv_pool_out``) or "rows" (``kv_rows``, see above)."""
    from onnx import TensorProto, helper

    if kv_out not in KV_OUT:
        raise ValueError(f"kv_out must be one of {KV_OUT}, got {kv_out!r}")

    cfg: ModelConfig = model.cfg
    B, T, nb, NB, bs = (shape.batch, shape.tokens, shape.table_blocks, shape.pool_blocks,
                        shape.block_size)
    L, H, KV, hd, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    S, N, eps = nb * bs, B * T, cfg.rms_norm_eps
    if model.rope_cos.shape[0] == 0:
        raise ValueError("prepare_rope(max_context) the model before building its ONNX step")
    g = _Builder()

    def w(hf_name: str) -> str:
        return g.weight(hf_name, model.p(hf_name))

    def opt(hf_name: str, t: torch.Tensor | None) -> str | None:
        return None if t is None else g.weight(hf_name, t)

    ids = g.shape("input_ids", N)
    x = g.op("Gather", w("model.embed_tokens.weight"), ids, axis=0)              # (N, D)
    pos = g.shape("positions", N)
    cos = g.shape(g.op("Gather", g.weight("rope.cos", model.rope_cos), pos, axis=0), B, T, 1, hd)
    sin = g.shape(g.op("Gather", g.weight("rope.sin", model.rope_sin), pos, axis=0), B, T, 1, hd)
    # the pool as (NB * L * 2, bs * KV * hd) rows (a free reshape): row blk * 2L + plane is block
    # blk's plane (2*i: layer i's keys, 2*i+1 its values), so each plane's blocks are one Gather
    # of exactly what it reads: one copy of the K/V per step (gathering all planes of the rows'
    # blocks first, then a plane of them, copied everything twice: 170 vs 121 ms at batch 4 on
    # SmolLM2-135M at 33 blocks)
    flat = g.shape("kv_pool", NB * L * 2, bs * KV * hd)
    first = g.op("Mul", "block_tables", g.const(np.array(L * 2, np.int64)))              # (B, nb)
    dims = AttnDims(B, T, H, KV, hd, S)
    attend = attend_decode if T == 1 else attend_chunk
    bias = attention_bias(g, dims)
    scale = g.const(np.float32(model.scale))
    updates: list[str] = []
    for i, lw in enumerate(model.layers):
        p = f"model.layers.{i}."
        h = _rms(g, x, w(p + "input_layernorm.weight"), eps)
        q = g.shape(_linear(g, h, N, w(p + "self_attn.q_proj.weight"),
                            opt(p + "self_attn.q_proj.bias", lw.q_bias)), B, T, H, hd)
        k = g.shape(_linear(g, h, N, w(p + "self_attn.k_proj.weight"),
                            opt(p + "self_attn.k_proj.bias", lw.k_bias)), B, T, KV, hd)
        v = g.shape(_linear(g, h, N, w(p + "self_attn.v_proj.weight"),
                            opt(p + "self_attn.v_proj.bias", lw.v_bias)), B, T, KV, hd)
        if lw.q_norm is not None:   # Qwen3: per head, over hd, before RoPE
            q = _rms(g, q, w(p + "self_attn.q_norm.weight"), eps)
            k = _rms(g, k, w(p + "self_attn.k_norm.weight"), eps)
        q, k = _rope(g, q, cos, sin, hd), _rope(g, k, cos, sin, hd)
        updates += [g.shape(k, N, KV, hd), g.shape(v, N, KV, hd)]
        att = attend(g, dims, q, k, v, gather_past(g, flat, first, 2 * i),
                     gather_past(g, flat, first, 2 * i + 1), bias, scale)         # (N, H*hd)
        x = g.op("Add", x, _linear(g, att, N, w(p + "self_attn.o_proj.weight"),
                                   opt(p + "self_attn.o_proj.bias", lw.o_bias)))
        h = _rms(g, x, w(p + "post_attention_layernorm.weight"), eps)
        gate = _linear(g, h, N, w(p + "mlp.gate_proj.weight"), None)
        up = _linear(g, h, N, w(p + "mlp.up_proj.weight"), None)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        x = g.op("Add", x, _linear(g, act, N, w(p + "mlp.down_proj.weight"), None))
    g.op("Reshape", _rms(g, x, w("model.norm.weight"), eps),
         g.const(np.array([B, T, D], np.int64)), out="hidden")
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    pool_dims = [NB, L, 2, bs, KV, hd]
    rows = g.op("Concat", *updates, axis=0, **({"out": "kv_rows"} if kv_out == "rows" else {}))
    if kv_out == "pool":   # every layer's new K/V into the pool at once: (block, layer, k|v, offset)
        slot = g.shape("slot_mapping", N, 1)
        blk = g.op("Div", slot, g.const(np.array(bs, np.int64)))
        off = g.op("Sub", slot, g.op("Mul", blk, g.const(np.array(bs, np.int64))))
        index = [g.op("Concat", blk, g.const(np.full((N, 1), i, np.int64)),
                      g.const(np.full((N, 1), kind, np.int64)), off, axis=1)
                 for i in range(L) for kind in (0, 1)]                          # each (N, 4)
        g.op("ScatterND", "kv_pool", g.op("Concat", *index, axis=0), rows, out="kv_pool_out")
        kv_info = helper.make_tensor_value_info("kv_pool_out", f32, pool_dims)
    else:
        kv_info = helper.make_tensor_value_info("kv_rows", f32, [2 * L * N, KV, hd])
    inputs = [helper.make_tensor_value_info("input_ids", i64, [B, T]),
              helper.make_tensor_value_info("positions", i64, [B, T]),
              helper.make_tensor_value_info("slot_mapping", i64, [N]),
              helper.make_tensor_value_info("block_tables", i64, [B, nb]),
              helper.make_tensor_value_info("attn_bias", f32, [B, 1, T, S + T]),
              helper.make_tensor_value_info("kv_pool", f32, pool_dims)]
    inputs += [helper.make_tensor_value_info(n, f32, list(t.shape)) for n, t in g.weights.items()]
    outputs = [helper.make_tensor_value_info("hidden", f32, [B, T, D]), kv_info]
    graph = helper.make_graph(g.nodes, "capsule_step", inputs, outputs, g.inits)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                   producer_name="capsule")

    return onnx_model.SerializeToString(), g.weights


HEAD_NAME = "lm_head.weight"   # the head's graph input (the embeddings' tensor when tied)


def build_head(model: Any, rows: int) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The LM head as an ONNX graph: ``hidden`` (rows, D) fp32 -> ``logits`` (rows, V), one Gemm
    over the model's own (V, D) head matrix (a graph input, as the step's weights are).

    The onnxruntime engine computes its logits here rather than in torch, so a process that
    never imports torch (``capsule.lite``) running the same graph on the same rows gets the same
    logits bit for bit, hence the same greedy tokens as the Session."""
    from onnx import TensorProto, helper

    g = _Builder()
    head = g.weight(HEAD_NAME, model.head_weight())
    V, D = model.head_weight().shape
    g.op("Gemm", "hidden", head, out="logits", transB=1)                         # (rows, V)
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(g.nodes, "capsule_head",
                              [helper.make_tensor_value_info("hidden", f32, [rows, D]),
                               helper.make_tensor_value_info(HEAD_NAME, f32, [V, D])],
                              [helper.make_tensor_value_info("logits", f32, [rows, V])], g.inits)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                   producer_name="capsule")
    return onnx_model.SerializeToString(), g.weights


def write_rows(kv_pool: torch.Tensor, slot_mapping: torch.Tensor, kv_rows: torch.Tensor) -> None:
    """Write a ``kv_out="rows"`` step's ``kv_rows`` (2 * L * N, KV, hd) into ``kv_pool``
    (NB, L, 2, bs, KV, hd) at slot_mapping (N,), in place: what the "pool" graph's ScatterND
    does. No host sync and no allocation beyond the index math (CUDA-graph capturable)."""
    NB, L, _, bs, KV, hd = kv_pool.shape
    N = slot_mapping.shape[0]
    blk = torch.div(slot_mapping, bs, rounding_mode="floor")
    # rows (L, 2, N, KV, hd) -> (N, L, 2, KV, hd): pool[blk[n], :, :, off[n]] takes token n's
    kv_pool[blk, :, :, slot_mapping - blk * bs] = kv_rows.view(L, 2, N, KV, hd).permute(2, 0, 1, 3, 4)


def step_bias(positions: torch.Tensor, n_past_slots: int, key_valid: torch.Tensor | None = None
              ) -> torch.Tensor:
    """attn_bias (B, 1, T, S + T): query t of row b sees past slot s when s < positions[b, 0]
    (and key_valid[b, s]), and the chunk's own tokens 0..t (causal)."""
    B, T = positions.shape
    s = torch.arange(n_past_slots, device=positions.device)
    past = (s[None, :] < positions[:, :1])                                   # (B, S)
    if key_valid is not None:
        past = past & key_valid
    own = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    seen = torch.cat([past[:, None, :].expand(B, T, n_past_slots), own.expand(B, T, T)], dim=-1)
    zero = torch.zeros((), dtype=torch.float32, device=positions.device)
    return torch.where(seen, zero, float("-inf")).unsqueeze(1)               # (B, 1, T, S+T)
