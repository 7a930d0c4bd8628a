"""A linear layer over GGUF Q8_0 weights on the CPU, in C: the int8 codes stay int8.

W[n, k] = codes[n, k] * scales[n, k // 32] (Q8_0: one fp16 scale per 32 weights, widened to fp32
once: exact), y = x . W^T in fp32. Why: with int4 layers the logits' matmul over the Q8_0 tied
embeddings was a decode step's largest read; kept as Q8_0 it reads ~1.1 bytes a weight, and the
logits are the dequantized model's up to summation order. Every output is summed in one fixed
order (csrc/q8_linear_cpu.c), so a row's result does not depend on the batch or the threads.

Hot path: the output is the one allocation; no host sync beyond what eager CPU code does.
"""
from __future__ import annotations

import numpy as np
import torch

from . import cpu_library

QBLOCK = 32                 # weights per scale (csrc: QBLOCK)
Q8_0_BLOCK_BYTES = 34       # a GGUF Q8_0 block: fp16 scale, 32 int8 codes


def missing() -> str | None:
    """Why the kernel cannot run here, or None."""
    return cpu_library.missing()


def q8_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 matrix's bytes (N, K/32 * 34) -> (codes (N, K) int8, scales (N, K/32) float32)
    with weight[n, k] = scales[n, k // 32] * codes[n, k]."""
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % Q8_0_BLOCK_BYTES:
        raise ValueError(f"Q8_0 bytes must be (N, K/32 * {Q8_0_BLOCK_BYTES}) uint8, got {raw.shape} {raw.dtype}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, Q8_0_BLOCK_BYTES)           # (N, K/32, 34)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)                   # (N, K)
    return codes, scales


def check_weights(codes: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless codes (N, K) int8 and scales (N, K/32) fp32 are contiguous CPU tensors
    of matching shapes with K a positive multiple of 32."""
    ok = (codes.dtype == torch.int8 and scales.dtype == torch.float32 and codes.dim() == 2
          and codes.device.type == "cpu" and scales.device.type == "cpu"
          and codes.shape[1] > 0 and codes.shape[1] % QBLOCK == 0 and codes.shape[0] > 0
          and tuple(scales.shape) == (codes.shape[0], codes.shape[1] // QBLOCK)
          and codes.is_contiguous() and scales.is_contiguous())
    if not ok:
        raise ValueError(f"Q8_0 weights must be contiguous CPU codes (N, K) int8 and scales (N, K/32) "
                         f"float32 with K a multiple of {QBLOCK}; got {tuple(codes.shape)} {codes.dtype} "
                         f"and {tuple(scales.shape)} {scales.dtype}")


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """x (..., K) fp32 on the CPU -> (..., N) fp32: x . W^T over Q8_0 weights (check_weights'
    layout; checked here). threads: the kernel's workers, the outputs split between them (on
    torch's OpenMP team where cpu_library found it, else pthreads started per call; the result
    is the same bits at any count). ValueError on bad arguments, RuntimeError when the kernel
    is missing or a thread could not be started."""
    check_weights(codes, scales)
    N, K = codes.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be fp32 (..., {K}) on the CPU, got {tuple(x.shape)} {x.dtype} on {x.device}")
    rows = x.reshape(-1, K).contiguous()                                       # (M, K)
    out = torch.empty(rows.shape[0], N, dtype=torch.float32)                   # (M, N)
    if rows.shape[0]:
        rc = cpu_library.library().capsule_q8_linear(rows.data_ptr(), rows.shape[0], codes.data_ptr(),
                                                     scales.data_ptr(), N, K, out.data_ptr(), max(1, threads))
        if rc != 0:
            raise RuntimeError("the CPU Q8_0 linear could not start its threads")
    return out.view(*x.shape[:-1], N)
