"""A linear layer over fp32 weights on the CPU, in C (csrc/f32_linear_cpu.c), for the one-call
decode step of a dense model (decode_step_cpu.py).

The matrix is up to three row blocks stacked (q, k and v as one q|k|v; gate and up as gate|up),
read in place: no copy of the checkpoint's tensors. Every output is summed in one fixed order
(16 lanes, then a tree), so a row's result does not depend on the batch, the threads or the
CPU's SIMD; it is not torch's (MKL's) order. As fast as torch's matmul at batch 1 here (both
stream the weights at the memory's speed: ~13.5 GB/s at one thread, ~26 at two).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from . import cpu_library
from .decode_step_abi import F32_PARTS, F32Parts


def missing() -> str | None:
    """Why the kernel cannot run here, or None."""
    return cpu_library.missing()


class F32Matrix:
    """W (N, K) fp32 as 1 .. F32_PARTS row blocks stacked, checked once here; keeps references to
    them. Threading: holds no per-call state (calls may run concurrently)."""

    def __init__(self, parts: Sequence[torch.Tensor]):
        if not 1 <= len(parts) <= F32_PARTS:
            raise ValueError(f"an fp32 matrix has 1 to {F32_PARTS} row blocks, got {len(parts)}")
        K = parts[0].shape[-1] if parts[0].dim() == 2 else -1
        for p in parts:
            if (p.dtype != torch.float32 or p.device.type != "cpu" or p.dim() != 2 or not p.is_contiguous()
                    or p.shape[0] < 1 or p.shape[1] != K or K < 1):
                raise ValueError(f"fp32 row blocks must be contiguous CPU float32 (rows, {K}) with rows >= 1, "
                                 f"got {tuple(p.shape)} {p.dtype} on {p.device}")
        self.parts = tuple(parts)
        self.n_out, self.n_in = sum(p.shape[0] for p in parts), K
        self.blocks = [(p.data_ptr(), p.shape[0]) for p in parts]   # (address, rows): decode_step_abi.f32_mat
        self._c = F32Parts(n=len(parts))
        for i, (address, rows) in enumerate(self.blocks):
            self._c.part[i], self._c.rows[i] = address, rows

    def __call__(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """x (..., K) fp32 on the CPU -> (..., N) fp32: x . W^T. The same bits at any threads.
        ValueError on a bad x; RuntimeError when the kernel is missing or a thread could not be
        started."""
        K = self.n_in
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != K:
            raise ValueError(f"x must be fp32 (..., {K}) on the CPU, got {tuple(x.shape)} {x.dtype} on {x.device}")
        rows = x.reshape(-1, K).contiguous()                                   # (M, K)
        out = torch.empty(rows.shape[0], self.n_out, dtype=torch.float32)      # (M, N)
        if rows.shape[0]:
            rc = cpu_library.library().capsule_f32_linear(rows.data_ptr(), rows.shape[0], ctypes.addressof(self._c),
                                                          K, out.data_ptr(), max(1, threads))
            if rc != 0:
                raise RuntimeError("the CPU fp32 linear could not start its threads")
        return out.view(*x.shape[:-1], self.n_out)
