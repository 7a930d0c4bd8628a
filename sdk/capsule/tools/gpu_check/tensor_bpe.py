"""GPU-check step `tensor_bpe`: the tensor BPE merges on 1M characters, exact vs the reference.

The tokenize-bpe bench's per-family measurement (tools/bench/tokenize_bpe.py) for one family
(cl100k_base, the builtin models' tokenizer) on the same text: on CUDA the merge kernel alone
(median of REPS after a warm-up, synchronized) and the whole TensorBpe.encode compared with
the reference's ids; its CPU tensor half is skipped there (seconds per 1M characters). Then,
on CUDA and while FUSED_RESERVE_S of the step's budget is left, the fused Triton merge loop
(kernel="triton": its ms, and exactness as check `fused_exact`; an exception is `fused_error`
and leaves the rest). On CPU the kernel runs on CPU tensors, on fewer characters (the fused
loop runs there only under Triton's interpreter: the tests check it). The same row carries the
regex split on tensors (``split_{cpu,cuda}_ms``, checked piece for piece as ``split_exact``)
and, on CUDA, the whole encode on the device (``device_encode_cuda_ms``, ``exact_device_cuda``).
ok: the torch loop's ids equal the reference's, and so do the fused loop's, the split's pieces
and the device encode's ids where they ran.
"""
from __future__ import annotations

import time
from typing import Any

from ..bench.tokenize import real_text
from ...tokenize.reference import load_reference
from ..bench.tokenize_bpe import GPU_TARGET_MS, best_cuda_ms, fused_cuda, measure_family

FAMILY = "cl100k_base"
CHARS, CPU_CHARS, QUICK_CPU_CHARS = 1_000_000, 100_000, 30_000
REPS, QUICK_REPS = 3, 1
FUSED_RESERVE_S = 20.0   # Triton compiles one variant per width bucket (~1 s each)


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    cuda = device == "cuda"
    chars = CHARS if cuda else (QUICK_CPU_CHARS if quick else CPU_CHARS)
    reps = QUICK_REPS if quick else REPS
    text = real_text(chars)
    row = measure_family(FAMILY, text, reps, cuda=cuda, cpu=not cuda, fused=False)
    out: dict[str, Any] = {**row, "reps": reps, "target_ms": GPU_TARGET_MS}
    if cuda:
        left = budget_s - (time.monotonic() - t0)
        if left >= FUSED_RESERVE_S:
            ref = load_reference(FAMILY)
            out.update(fused_cuda(ref, text, ref.encode(text), reps))
            if "fused_error" not in out:   # ran: wrong ids are a failure, an error is not
                out["checks"] = {"fused_exact": bool(out.get("exact_fused_cuda"))}
        else:
            out["fused_error"] = f"skipped: {left:.0f} s of the step's budget left"
        out["target_met"] = best_cuda_ms(out) < GPU_TARGET_MS
    for key in ("split_exact", "exact_device_cuda"):   # the device tokenization, where it ran
        if out.get(key) is not None:
            out.setdefault("checks", {})[key] = bool(out[key])
    failed = [k for k, v in out.get("checks", {}).items() if not v]
    out["ok"] = bool(row["exact"]) and not failed
    if not row["exact"]:
        out["error"] = f"TensorBpe ids differ from the {FAMILY} reference's on {chars:,} characters"
    elif failed:
        out["error"] = f"differs from the reference: {', '.join(failed)}"
    return out
