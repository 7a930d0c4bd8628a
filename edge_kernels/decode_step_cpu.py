"""A whole decode step of a decoder on the CPU whose every layer is int4 (Q4Matrix) or every layer
fp32 (F32Matrix), in one C call (csrc/decode_step_cpu.c): per layer RMSNorm, q|k|v, RoPE + the
K/V write + paged attention, o, RMSNorm, gate|up, SwiGLU, down, the residuals; then the final
RMSNorm. It replaces the decoder's Python loop over the layers (~40 torch operators a layer) for
one new token per row.

The weights are checked once (DecodeStep); a step checks the rows (a DecodePlan with slots and
RoPE tables: paged_decode_cpu) and the pool. Its numerics are fixed (the C file says how), the
same bits at any thread count; not torch's summation order for the matmuls, norms and SwiGLU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .decode_step_abi import Layer, Mat, Step, f32_mat, matrix_shapes, q4_mat, run
from .f32_linear_cpu import F32Matrix
from .paged_decode_cpu import DecodePlan, check_layer
from .q4_linear_cpu import Q4Matrix

Matrix = Q4Matrix | F32Matrix

@dataclass(frozen=True)
class StepLayer:
    """One layer's weights: norms (D,) fp32; q|k|v ((H + 2 KV) hd, D), o (D, H hd), gate|up (2 I, D)
    and down (D, I), all Q4Matrix or all F32Matrix; optional fp32 biases of q|k|v and o."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def _vector(t: torch.Tensor | None, n: int, what: str) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (n,) or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous fp32 CPU vector of {n}, got {tuple(t.shape)} {t.dtype}")
    return t.data_ptr()


def _mat(m: Matrix, kind: type, shape: tuple[int, int], bias: torch.Tensor | None, what: str) -> Mat:
    if not isinstance(m, kind):
        raise ValueError(f"{what} must be a {kind.__name__} like the first layer's q|k|v, got {type(m).__name__}")
    if (m.n_out, m.n_in) != shape:
        raise ValueError(f"{what} must be {shape}, got ({m.n_out}, {m.n_in})")
    b = _vector(bias, shape[0], f"{what}'s bias")
    if isinstance(m, Q4Matrix):
        return q4_mat(m.nib.data_ptr(), m.d.data_ptr(), m.mt.data_ptr(), b)
    return f32_mat(m.blocks, b)


class DecodeStep:
    """An all-int4 or all-fp32 decoder's decode step (see the module docstring); keeps references to the
    layers' tensors. Threading: it holds no per-call state, so calls may run concurrently when
    they write different pool slots (as any two decode steps must)."""

    def __init__(self, layers: Sequence[StepLayer], final_norm: torch.Tensor, *, heads: int, kv_heads: int,
                 head_dim: int, eps: float):
        if not layers:
            raise ValueError("a decode step needs at least one layer")
        D = final_norm.shape[0] if final_norm.dim() == 1 else -1
        I = layers[0].down.n_in
        H, KV, hd = heads, kv_heads, head_dim
        if D < 1 or H < 1 or KV < 1 or H % KV or hd < 1:
            raise ValueError(f"bad shape: D {D}, heads {H}, kv heads {KV}, head size {hd}")
        shapes = matrix_shapes(D, I, H, KV, hd)
        kind = Q4Matrix if isinstance(layers[0].qkv, Q4Matrix) else F32Matrix
        structs = []
        for i, lw in enumerate(layers):
            p = f"layer {i}'s"
            structs.append(Layer(_vector(lw.in_norm, D, f"{p} input norm"), _vector(lw.post_norm, D, f"{p} post norm"),
                                  _mat(lw.qkv, kind, shapes["qkv"], lw.qkv_bias, f"{p} q|k|v"),
                                  _mat(lw.o, kind, shapes["o"], lw.o_bias, f"{p} o"),
                                  _mat(lw.gate_up, kind, shapes["gate_up"], None, f"{p} gate|up"),
                                  _mat(lw.down, kind, shapes["down"], None, f"{p} down")))
        self.layers = (Layer * len(structs))(*structs)
        self._keep = (list(layers), final_norm)
        self.final_norm = _vector(final_norm, D, "the final norm")
        self.L, self.D, self.I, self.H, self.KV, self.hd, self.eps = len(structs), D, I, H, KV, hd, float(eps)

    def __call__(self, x: torch.Tensor, plan: DecodePlan, kv_pool: torch.Tensor, scale: float,
                 threads: int = 1) -> torch.Tensor:
        """x (B, D) fp32: the rows' embeddings -> (B, D) the final normed hidden states. The new
        K/V go into the plan's slots of every layer of kv_pool (NB, L, 2, bs, KV, hd), fp32 or
        bf16. ValueError on bad arguments, RuntimeError when the kernel is missing or could not
        get memory or threads."""
        B = plan.tables.shape[0]
        if x.dtype != torch.float32 or x.device.type != "cpu" or tuple(x.shape) != (B, self.D):
            raise ValueError(f"x must be fp32 ({B}, {self.D}) on the CPU, got {tuple(x.shape)} {x.dtype}")
        if plan.slots is None or plan.cos is None or plan.sin is None or plan.cos.shape != (B, self.hd):
            raise ValueError("the DecodePlan needs slots and RoPE tables of the step's rows")
        want = (plan.num_blocks, self.L, 2, plan.block_size, self.KV, self.hd)
        if tuple(kv_pool.shape) != want:   # the plan checked its ids against num_blocks
            raise ValueError(f"kv_pool must be {want} (the plan's pool), got {tuple(kv_pool.shape)}")
        check_layer(torch.empty(B, self.H, self.hd), kv_pool[:, 0, 0], kv_pool[:, 0, 1])
        stride = kv_pool.stride()
        rows = x.contiguous().clone()                                          # the residual stream
        out = torch.empty(B, self.D, dtype=torch.float32)
        if B == 0:
            return out
        s = Step(self.L, self.D, self.I, self.H, self.KV, self.hd, self.eps, float(scale), self.final_norm,
                  kv_pool.data_ptr(), kv_pool.dtype == torch.bfloat16, stride[0], stride[1], stride[2],
                  plan.block_size, B, plan.tables.shape[1], plan.cos.data_ptr(), plan.sin.data_ptr(),
                  plan.slots.data_ptr(), plan.tables.data_ptr(), plan.lens.data_ptr(),
                  None if plan.valid is None else plan.valid.data_ptr())
        run(self.layers, s, rows.data_ptr(), out.data_ptr(), threads)
        return out
