"""The decode step of a model whose every layer is int4 in the C kernel, run as one C call
(edge_kernels.decode_step_cpu) instead of the Decoder's Python loop over its layers.

Where it applies: every layer an Int4Linears of Q4KernelMatrix (runtime.linears "int4" with the
package's C kernels built, all layers Q4), no q/k norm (Qwen3's), fp32 on the CPU, and the C
decode attention (decode_attention "cpu"). Elsewhere None: the Decoder keeps its loop. Its
norms and SwiGLU sum in their own fixed order (not torch's), part of the int4 path's numerics
that a capsule binds (int4_activations "int16").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from edge_kernels.decode_step_cpu import Q4DecodeStep, Q4Layer

from .config import ModelConfig
from .int4_linear import Int4Linears, Q4KernelMatrix
from .linears import LayerLinears

if TYPE_CHECKING:
    from .model import _LayerWeights


def q4_decode_step(cfg: ModelConfig, weights: "Sequence[_LayerWeights]", linears: Sequence[LayerLinears],
                   final_norm: torch.Tensor) -> Q4DecodeStep | None:
    """The one-call decode step for these layers, or None where it does not apply (see above)."""
    if cfg.qk_norm or final_norm.dtype != torch.float32 or final_norm.device.type != "cpu":
        return None
    if not linears or not all(isinstance(lin, Int4Linears) and isinstance(lin.qkv_m, Q4KernelMatrix)
                              for lin in linears):
        return None
    layers = [Q4Layer(w.in_norm, w.post_norm, lin.qkv_m.matrix, lin.o_m.matrix, lin.gate_up.matrix,
                      lin.down.matrix, lin.qkv_bias, lin.o_bias)
              for w, lin in zip(weights, linears)]
    return Q4DecodeStep(layers, final_norm, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
