"""A linear layer over GGUF Q4_0 / Q4_1 weights on the CPU, in C: the 4-bit codes stay 4-bit.

W[n, 32 b + j] = d[n, b] * q + m[n, b] (Q4_1; Q4_0 is m = -8 d), q the 4-bit code, held as the
GGUF's own nibbles (N, K/2): byte j of a block's 16 holds element j (low nibble) and j + 16
(high). y = x . W^T in fp32, with each 32-block of x rounded to int16 on a scale of its own
(~256x finer than the bf16 activations of torch's int4 kernel) and the code x activation sums
exact in int32 (csrc/q4_linear_cpu.c). Every output is summed in one fixed order, so a row's
result does not depend on the batch, the threads, or the CPU's SIMD (AVX-512, AVX2, portable).

Hot path: the output is the one tensor allocated (the kernel mallocs its int16 activations).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu_library

QBLOCK = 32                 # weights per (d, m) (csrc: QBLOCK)
# csrc: capsule_q4_linear's `path`: the widest SIMD this CPU has, or one named (the tests check
# that every path the CPU has gives the same bits)
PATHS = {"fastest": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512-vnni": 4}


def missing() -> str | None:
    """Why the kernel cannot run here, or None."""
    return cpu_library.missing()


@functools.cache
def fastest_path() -> str:
    """The path "fastest" runs on this CPU (a name in PATHS other than "fastest"); asked of the
    kernel once per process."""
    x, w = torch.ones(1, 32), (torch.zeros(16, 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(1, 16))
    for name in ("avx512-vnni", "avx512", "avx2"):
        try:
            q4_linear(x, *w, path=name)
            return name
        except ValueError:
            pass
    return "portable"


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (N, K) in 0..15, d and m (N, K/32) fp32) -> the kernel's (nibbles (N, K/2) uint8,
    d (N, K/32) fp32, m transposed (K/32, N) fp32), all contiguous."""
    n, k = codes.shape
    if k % QBLOCK or d.shape != (n, k // QBLOCK) or m.shape != d.shape:
        raise ValueError(f"codes (N, K) with K a multiple of {QBLOCK} and d, m (N, K/{QBLOCK}); "
                         f"got {codes.shape}, {d.shape}, {m.shape}")
    c = codes.astype(np.uint8).reshape(n, k // QBLOCK, 2, 16)                     # (N, nb, lo/hi, 16)
    nib = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)
    return (np.ascontiguousarray(nib), np.ascontiguousarray(d, dtype=np.float32),
            np.ascontiguousarray(m.T, dtype=np.float32))


def check_weights(nib: torch.Tensor, d: torch.Tensor, mt: torch.Tensor) -> None:
    """ValueError unless nib (N, K/2) uint8, d (N, K/32) fp32 and mt (K/32, N) fp32 are contiguous
    CPU tensors of matching shapes, K a positive multiple of 32."""
    ok = (nib.dtype == torch.uint8 and d.dtype == torch.float32 and mt.dtype == torch.float32
          and nib.dim() == 2 and d.dim() == 2 and mt.dim() == 2
          and all(t.device.type == "cpu" and t.is_contiguous() for t in (nib, d, mt))
          and nib.shape[0] > 0 and nib.shape[1] > 0 and (2 * nib.shape[1]) % QBLOCK == 0
          and tuple(d.shape) == (nib.shape[0], 2 * nib.shape[1] // QBLOCK)
          and tuple(mt.shape) == (d.shape[1], d.shape[0]))
    if not ok:
        raise ValueError(f"Q4 weights must be contiguous CPU nibbles (N, K/2) uint8, d (N, K/32) float32 and "
                         f"m (K/32, N) float32 with K a multiple of {QBLOCK}; got {tuple(nib.shape)} {nib.dtype}, "
                         f"{tuple(d.shape)} {d.dtype} and {tuple(mt.shape)} {mt.dtype}")


def q4_linear(x: torch.Tensor, nib: torch.Tensor, d: torch.Tensor, mt: torch.Tensor, threads: int = 1,
              path: str = "fastest") -> torch.Tensor:
    """x (..., K) fp32 on the CPU -> (..., N) fp32: x . W^T over Q4 weights (pack's layout;
    checked here). threads: the kernel's workers, the outputs split between them (on torch's
    OpenMP team where cpu_library found it, else pthreads started per call); path: one of
    PATHS. The same bits at any threads and path. ValueError on bad arguments or a path this
    CPU lacks; RuntimeError when the kernel is missing, a thread could not be started, or the
    activations' buffer could not be allocated."""
    check_weights(nib, d, mt)
    N, K = nib.shape[0], 2 * nib.shape[1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be fp32 (..., {K}) on the CPU, got {tuple(x.shape)} {x.dtype} on {x.device}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
    out = _run(x.reshape(-1, K).contiguous(), (nib.data_ptr(), d.data_ptr(), mt.data_ptr()), N, threads, path)
    return out.view(*x.shape[:-1], N)


def _run(rows: torch.Tensor, ptrs: tuple[int, int, int], N: int, threads: int, path: str) -> torch.Tensor:
    """rows (M, K) fp32 contiguous, weights (nib, d, mt addresses, checked) -> (M, N): the C call,
    its failures raised (q4_linear says which)."""
    M, K = rows.shape
    out = torch.empty(M, N, dtype=torch.float32)                               # (M, N)
    if M:
        rc = cpu_library.library().capsule_q4_linear(rows.data_ptr(), M, *ptrs, N, K, out.data_ptr(),
                                                     max(1, threads), PATHS[path])
        if rc == -3:
            raise ValueError(f"this CPU cannot run the Q4 linear's {path!r} path")
        if rc == -2:
            raise RuntimeError(f"the CPU Q4 linear could not allocate its activations ({M} x {K})")
        if rc != 0:
            raise RuntimeError("the CPU Q4 linear could not start its threads")
    return out


DENSE_ROWS = 128   # from this many rows of x (a prefill chunk) Q4Matrix multiplies dequantized


class Q4Matrix:
    """y = x . W^T over one Q4 matrix (pack's layout), its weights checked once here: the hot
    path per call is a shape check, the output's allocation and the C call.

    Below DENSE_ROWS rows of x (decode), the int16 kernel (q4_linear); from DENSE_ROWS on (a
    prefill chunk), torch's fp32 matmul over the matrix dequantized for the call (dequantized():
    the GGUF's exact weights; ~1.9x faster at 512 rows here, the int16 kernel ~1.1x slower at
    128, faster below 64). Which one runs depends on the row count alone, so a given call's bits
    do too. Threading: `threads` is read per call (the caller's current count); the same bits at
    any count on the int16 path."""

    def __init__(self, nib: torch.Tensor, d: torch.Tensor, mt: torch.Tensor):
        check_weights(nib, d, mt)
        self.nib, self.d, self.mt = nib, d, mt
        self.n_out, self.n_in = nib.shape[0], 2 * nib.shape[1]
        self._ptrs = (nib.data_ptr(), d.data_ptr(), mt.data_ptr())

    def dequantized(self, threads: int = 1) -> torch.Tensor:
        """The weights as fp32 (N, K): every one the GGUF's own dequantized value, bit for bit
        (csrc/q4_dequant_cpu.c). A new tensor each call."""
        w = torch.empty(self.n_out, self.n_in, dtype=torch.float32)
        nib, d, mt = self._ptrs
        if cpu_library.library().capsule_q4_dequantize(nib, d, mt, self.n_out, self.n_in, w.data_ptr(), threads):
            raise RuntimeError("the CPU Q4 dequantization could not start its threads")
        return w

    def __call__(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        K = self.n_in
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != K:
            raise ValueError(f"x must be fp32 (..., {K}) on the CPU, got {tuple(x.shape)} {x.dtype} on {x.device}")
        rows = x.reshape(-1, K).contiguous()                                   # (M, K)
        if rows.shape[0] >= DENSE_ROWS:
            out = F.linear(rows, self.dequantized(threads))
        else:
            out = _run(rows, self._ptrs, self.n_out, threads, "fastest")
        return out.view(*x.shape[:-1], self.n_out)
