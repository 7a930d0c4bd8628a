"""`capsule bench --suite tokenize-bpe`: the tensor BPE kernel on a 1M-character text.

For each family: CPU regex pre-tokenization time, then the merge kernel (``edge_kernels.bpe``:
the pieces the kernel receives, packed once, merged ``reps`` times after one warm-up run) on
CPU tensors and, when a CUDA GPU is present, on CUDA (timed with a synchronize) by both merge
loops (``kernel="torch"`` and the fused Triton ``kernel="triton"``; a Triton failure is
recorded as ``fused_error`` and leaves the other figures), the whole
``TensorBpe.encode`` and a full ``reference.encode`` of the same text, and exactness; for the
GPT-family patterns also the regex split on tensors and, on CUDA, the whole encode on the
device (``tokenize_device``).
CPU kernel speed is informational; the GPU target is 1M characters well under 10 ms.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from edge_kernels.bpe import merge_packed, pack_pieces

from ...tokenize.reference import load_reference
from ...tokenize.registry import all_families
from ...tokenize.tensor_bpe import TensorBpe, unsupported
from . import BenchOptions, SuiteResult
from .tokenize import real_text
from .tokenize_device import device_columns

CHARS, QUICK_CHARS = 1_000_000, 200_000
REPS, QUICK_REPS = 3, 1
GPU_TARGET_MS = 10.0


def _median_ms(fn: Callable[[], Any], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()   # warm-up (allocator, kernels) is not timed
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure_family(fam: str, text: str, reps: int, cuda: bool, cpu: bool = True,
                   fused: bool = True) -> dict[str, Any]:
    """One family's row. cpu=False leaves out the CPU tensor kernel and CPU TensorBpe.encode
    (seconds per 1M characters: what a GPU check with a time budget skips); the reference
    encode, the pre-tokenization and, with cuda, the CUDA kernel and its exactness still run.
    fused=False leaves out the fused Triton loop (``fused_cuda`` measures it on its own)."""
    if not (cpu or cuda):
        raise ValueError("measure_family needs cpu=True or cuda=True: nothing would be measured")
    ref = load_reference(fam)
    ref.encode("warm up")
    bpe = TensorBpe(ref) if cpu else TensorBpe(ref, device="cuda")
    t0 = time.perf_counter()
    plan = bpe.pre_tokenize(text)
    pre_ms = (time.perf_counter() - t0) * 1e3
    pieces = [p for p in plan if isinstance(p, bytes) and p not in bpe.whole_pieces]
    row: dict[str, Any] = {
        "family": fam, "chars": len(text), "pieces": len(plan), "kernel_pieces": len(pieces),
        "pretokenize_ms": pre_ms, "kernel_cpu_ms": None, "kernel_cuda_ms": None,
        "kernel_fused_cuda_ms": None, "encode_ms": None,
        "reference_ms": _median_ms(lambda: ref.encode(text), reps)}
    want = ref.encode(text)
    if cpu:
        packed = pack_pieces(pieces, bpe.table)
        row["kernel_cpu_ms"] = _median_ms(lambda: merge_packed(packed, bpe.table), reps)
        row["encode_ms"] = _median_ms(lambda: bpe.encode(text), reps)
    if cuda:
        gpu = bpe if not cpu else TensorBpe(ref, device="cuda")
        packed_gpu = pack_pieces(pieces, gpu.table)
        row["kernel_cuda_ms"] = _median_ms(lambda: merge_packed(packed_gpu, gpu.table), reps,
                                           torch.cuda.synchronize)
        row["exact_cuda"] = gpu.encode(text) == want
        if fused:
            row.update(fused_cuda(ref, text, want, reps, pieces))
    row["exact"] = (bpe.encode(text) == want) if cpu else row["exact_cuda"]
    row.update(device_columns(ref, text, want, reps, cpu, cuda, _median_ms))
    return row


def fused_cuda(ref: Any, text: str, want: list[int], reps: int,
               pieces: list[bytes] | None = None) -> dict[str, Any]:
    """The fused Triton merge loop on CUDA: kernel ms (the pieces that are not whole tokens,
    packed once) and exactness of the whole encode, or the error it raised."""
    try:
        fused = TensorBpe(ref, device="cuda", kernel="triton")
        if pieces is None:
            pieces = [p for p in fused.pre_tokenize(text)
                      if isinstance(p, bytes) and p not in fused.whole_pieces]
        packed = pack_pieces(pieces, fused.table)
        ms = _median_ms(lambda: fused.merge_packed(packed), reps, torch.cuda.synchronize)
        return {"kernel_fused_cuda_ms": ms, "exact_fused_cuda": fused.encode(text) == want}
    except Exception as exc:   # noqa: BLE001 - a first GPU run of a kernel: report, go on
        return {"fused_error": f"{type(exc).__name__}: {exc}"[:2000], "exact_fused_cuda": False}


def best_cuda_ms(row: dict[str, Any]) -> float:
    """The faster of a row's two CUDA merge loops (the fused one only where it was exact)."""
    fused = row.get("kernel_fused_cuda_ms") if row.get("exact_fused_cuda") else None
    return min(v for v in (row["kernel_cuda_ms"], fused) if v is not None)


def run(opts: BenchOptions) -> SuiteResult:
    n = QUICK_CHARS if opts.quick else CHARS
    reps = opts.steps or (QUICK_REPS if opts.quick else REPS)
    cuda = torch.cuda.is_available() and opts.device in ("auto", "cuda")
    text = real_text(n)
    rows = []
    # the tensor BPE runs the verified char-aligned pipelines; the others are listed, not measured
    why_not = {f.name: unsupported(load_reference(f.name, prefetch=False))
               for f in all_families()}
    names = [n for n, why in why_not.items() if not why]
    for fam in names:
        rows.append(measure_family(fam, text, reps, cuda))
        if opts.progress:
            r = rows[-1]
            print(f"  {fam}: kernel {r['kernel_cpu_ms']:.0f} ms CPU"
                  + (f", {r['kernel_cuda_ms']:.2f} ms CUDA" if r["kernel_cuda_ms"] is not None else "")
                  + (f", fused {r['kernel_fused_cuda_ms']:.2f} ms" if r["kernel_fused_cuda_ms"] is not None
                     else "")
                  + f"; exact {r['exact']}", flush=True)
    gpu = [best_cuda_ms(r) for r in rows if r["kernel_cuda_ms"] is not None]
    targets = [{"target": f"{n:,} chars merged on a CUDA GPU in well under {GPU_TARGET_MS:.0f} ms",
                "measured": " / ".join(f"{v:.2f} ms" for v in gpu) if gpu else "no CUDA GPU here",
                "met": ("yes" if max(gpu) < GPU_TARGET_MS else "NO") if gpu else "not measured"},
               {"target": "exact: TensorBpe ids == reference ids",
                "measured": str(all(r["exact"] and r.get("exact_cuda", True) for r in rows)),
                "met": "yes" if all(r["exact"] and r.get("exact_cuda", True) for r in rows) else "NO"}]
    if cuda:
        fused_ok = all(r.get("exact_fused_cuda") for r in rows)
        targets.append({"target": "fused Triton merges (kernel='triton') exact on CUDA",
                        "measured": str(fused_ok) + "".join(f"; {r['family']}: {r['fused_error']}"
                                                            for r in rows if r.get("fused_error")),
                        "met": "yes" if fused_ok else "NO"})
    settings = {"chars": n, "reps": reps, "families": names, "cuda": cuda,
                "not_run": {n: why for n, why in why_not.items() if why},
                "text": "installed .py sources in sorted order (as the tokenize suite)",
                "kernel": "pieces that are not whole tokens, packed once; merge rounds only",
                "quick": opts.quick}
    return SuiteResult(settings=settings, results={"runs": rows, "targets": targets},
                       tables={"tensor BPE, 1 text": rows, "targets": targets})
