"""`capsule doctor`'s probes of the package's C CPU kernels: the paged decode attention against
torch's, the Q4 and fp32 linears against float64 products (and the Q4 one's SIMD path against
the portable one's bits, the fp32 one's at two thread counts). Each reports MISSING, saying why, where the install could not build the kernels."""
from __future__ import annotations

from pathlib import Path

from ..policy.probe import FAILED, MISSING, OK, Check


def probe_decode_kernel(work: Path) -> Check:
    """The C paged decode kernel ("auto" decode attention on CPU) against torch's attention on a
    small pool with holes; MISSING (saying why) where the install could not build it."""
    import torch

    from edge_kernels.cpu_library import shares_openmp
    from edge_kernels.paged_decode_cpu import kernel_threads, missing, paged_decode_attention_cpu

    from ..llm.paged_attention import paged_attention

    why = missing()
    if why:
        return Check("decode kernel", MISSING, "-", f"{why}; decode attention 'auto' uses torch's")
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(8, 1, 2, 16, 2, 64, generator=g)          # (NB, L, 2, bs, KV, hd)
    q = torch.randn(2, 4, 64, generator=g)                        # (B, H, hd)
    tables, lens = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([40, 7])
    valid = torch.ones(8, 16, dtype=torch.bool)
    valid[2, 3:9] = False
    want = paged_attention(q.unsqueeze(1), pool[:, 0, 0], pool[:, 0, 1], tables, (lens - 1).view(2, 1),
                           0.125, valid[tables].view(2, -1))[:, 0]
    got = paged_decode_attention_cpu(q, pool[:, 0, 0], pool[:, 0, 1], tables, lens, 0.125, valid)
    err = (got - want).abs().max().item()
    # where its workers run: torch's own OpenMP team, or pthreads (then 1 between torch's operators)
    workers = (f"{kernel_threads()} workers on torch's OpenMP team" if shares_openmp()
               else "1 worker between torch's operators (torch's OpenMP runtime not found: pthreads)")
    return Check("decode kernel", OK if err < 1e-5 else FAILED, "C",
                 f"paged decode attention vs torch's: max |diff| {err:.1e} (decode attention 'auto' uses it on "
                 f"CPU); {workers}")


def probe_int4_kernel(work: Path) -> Check:
    """The C Q4 linear (runtime.linears 'int4') against float64 products on a small Q4_1 matrix,
    and its fastest SIMD path against the portable one (the same bits); MISSING where the install
    could not build it (int4 then runs on torch's bf16 kernel)."""
    import numpy as np
    import torch

    from edge_kernels.q4_linear_cpu import fastest_path, missing, pack, q4_linear

    from ..llm.int4_linear import Q4KernelMatrix, matrix_type

    why = missing()
    if why:
        return Check("int4 kernel", MISSING, "-", f"{why}; runtime.linears 'int4' uses torch's bf16 kernel")
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (48, 160), dtype=np.uint8)            # 5 blocks: a last quad of one
    d, m = rng.random((48, 5), dtype=np.float32) * 0.01, rng.normal(0, 0.05, (48, 5)).astype(np.float32)
    w = (codes.reshape(48, 5, 32) * d[..., None] + m[..., None]).reshape(48, 160).astype(np.float64)
    x = torch.from_numpy(rng.normal(size=(3, 160)).astype(np.float32))
    nib, dd, mt = (torch.from_numpy(a) for a in pack(codes, d, m))
    got = q4_linear(x, nib, dd, mt, threads=2)
    err = float(np.abs(got.numpy() - x.double().numpy() @ w.T).max())
    same = torch.equal(got, q4_linear(x, nib, dd, mt, path="portable"))
    path = fastest_path()
    ok = err < 1e-4 and same
    used = ("runtime.linears 'int4' uses it" if matrix_type() is Q4KernelMatrix
            else "runtime.linears 'int4' uses torch's bf16 kernel here (no SIMD path for this CPU)")
    return Check("int4 kernel", OK if ok else FAILED, "C",
                 f"Q4 linear vs float64: max |diff| {err:.1e}; {path} path "
                 f"{'gives the portable path' if same else 'DIFFERS from the portable path'}'s bits; {used}")


def probe_f32_kernel(work: Path) -> Check:
    """The C fp32 linear (the one-call decode step of a dense model: runtime.decode_step 'auto')
    against float64 products on a small matrix of two row blocks, and its bits at 1 and 3 threads;
    MISSING where the install could not build it (a dense model then decodes layer by layer)."""
    import torch

    from edge_kernels.f32_linear_cpu import F32Matrix, missing

    why = missing()
    if why:
        return Check("fp32 kernel", MISSING, "-", f"{why}; runtime.decode_step 'auto' runs the layer loop")
    g = torch.Generator().manual_seed(0)
    top, bottom = torch.randn(40, 100, generator=g), torch.randn(9, 100, generator=g)
    x = torch.randn(3, 100, generator=g)
    m = F32Matrix([top, bottom])
    got = m(x, threads=1)
    err = (got.double() - x.double() @ torch.cat([top, bottom]).double().T).abs().max().item()
    same = torch.equal(got, m(x, threads=3))
    return Check("fp32 kernel", OK if err < 1e-4 and same else FAILED, "C",
                 f"fp32 linear vs float64: max |diff| {err:.1e}; {'the same' if same else 'OTHER'} bits at 1 and 3 "
                 "threads; runtime.decode_step 'auto' decodes a dense fp32 model in one C call with it")
