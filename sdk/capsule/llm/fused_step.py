"""The decode step of a model whose every layer is int4 in the C kernel, or every layer dense
fp32, run as one C call (edge_kernels.decode_step_cpu) instead of the Decoder's Python loop over
its layers (~40 torch operators a layer).

Where it can run (fused_step_unsupported says why not): every layer an Int4Linears of
Q4KernelMatrix (runtime.linears "int4" with the package's C kernels built, all layers Q4), or
every layer DenseLinears of fp32 CPU tensors; no q/k norm (Qwen3's), an fp32 model on the CPU.
It runs only under the C decode attention (decode_attention "cpu"). Its matmuls, norms and
SwiGLU sum in their own fixed order (not torch's): a capsule binds it (runtime.decode_step).
"""
from __future__ import annotations

from typing import Sequence

import torch

from edge_kernels import cpu_library
from edge_kernels.decode_step_abi import MATRICES, f32_blocks
from edge_kernels.decode_step_cpu import DecodeStep, StepLayer
from edge_kernels.f32_linear_cpu import F32Matrix

from .config import ModelConfig
from .int4_linear import Int4Linears, Q4KernelMatrix
from .layer_weights import LayerWeights
from .linears import DenseLinears, LayerLinears


def _int4(lin: LayerLinears) -> bool:
    return isinstance(lin, Int4Linears) and isinstance(lin.qkv_m, Q4KernelMatrix)


def _dense(lin: LayerLinears) -> bool:
    return isinstance(lin, DenseLinears) and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
        for t in (lin.q, lin.k, lin.v, lin.o_w, lin.gate, lin.up, lin.down))


def fused_step_unsupported(cfg: ModelConfig, linears: Sequence[LayerLinears], final_norm: torch.Tensor) -> str | None:
    """Why these layers cannot decode in one C call, or None."""
    if cpu_library.missing():
        return str(cpu_library.missing())
    if cfg.qk_norm:
        return "the model normalizes q and k per head (Qwen3), which the C step does not"
    if final_norm.dtype != torch.float32 or final_norm.device.type != "cpu":
        return f"the model is {final_norm.dtype} on {final_norm.device}, the C step runs fp32 on the CPU"
    if not linears or not (all(map(_int4, linears)) or all(map(_dense, linears))):
        return "its layers are not all int4 in the C kernel nor all dense fp32 (contiguous, on the CPU)"
    return None


def dense_projections(lin: DenseLinears) -> dict[str, torch.Tensor]:
    """A dense layer's weights by projection name (decode_step_abi.f32_blocks' names)."""
    return {"q": lin.q, "k": lin.k, "v": lin.v, "o": lin.o_w, "gate": lin.gate, "up": lin.up, "down": lin.down}


def dense_qkv_bias(lin: DenseLinears) -> torch.Tensor | None:
    """q|k|v's biases as one vector (a missing one as zeros), or None when there are none."""
    pairs = ((lin.q_bias, lin.q), (lin.k_bias, lin.k), (lin.v_bias, lin.v))
    if all(b is None for b, _ in pairs):
        return None
    return torch.cat([b if b is not None else torch.zeros(w.shape[0]) for b, w in pairs])


def fused_decode_step(cfg: ModelConfig, weights: Sequence[LayerWeights], linears: Sequence[LayerLinears],
                      final_norm: torch.Tensor) -> DecodeStep:
    """The one-call decode step for these layers; ValueError where fused_step_unsupported says why."""
    why = fused_step_unsupported(cfg, linears, final_norm)
    if why:
        raise ValueError(f"no one-call decode step: {why}")
    layers = []
    for w, lin in zip(weights, linears):
        if isinstance(lin, Int4Linears):
            layers.append(StepLayer(w.in_norm, w.post_norm, lin.qkv_m.matrix, lin.o_m.matrix, lin.gate_up.matrix,
                                    lin.down.matrix, lin.qkv_bias, lin.o_bias))
        else:
            assert isinstance(lin, DenseLinears)   # fused_step_unsupported checked every layer
            t, blocks = dense_projections(lin), f32_blocks(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                                           cfg.num_kv_heads, cfg.head_dim)
            m = {name: F32Matrix([t[p] for p, _ in blocks[name]]) for name in MATRICES}
            layers.append(StepLayer(w.in_norm, w.post_norm, m["qkv"], m["o"], m["gate_up"], m["down"],
                                    dense_qkv_bias(lin), lin.o_bias))
    return DecodeStep(layers, final_norm, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
