"""GPU-check step `tensor_bpe`: the tensor BPE merges on 1M characters, exact vs the reference.

The tokenize-bpe bench's per-family measurement (tools/bench/tokenize_bpe.py) for one family
(cl100k_base, the builtin models' tokenizer) on the same text: on CUDA the merge kernel alone
(median of REPS after a warm-up, synchronized) and the whole TensorBpe.encode compared with
the reference's ids; its CPU tensor half is skipped there (seconds per 1M characters). On CPU
the kernel runs on CPU tensors, on fewer characters. ok: the ids equal the reference's.
"""
from __future__ import annotations

from typing import Any

from ..bench.tokenize import real_text
from ..bench.tokenize_bpe import GPU_TARGET_MS, measure_family

FAMILY = "cl100k_base"
CHARS, CPU_CHARS, QUICK_CPU_CHARS = 1_000_000, 100_000, 30_000
REPS, QUICK_REPS = 3, 1


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    cuda = device == "cuda"
    chars = CHARS if cuda else (QUICK_CPU_CHARS if quick else CPU_CHARS)
    row = measure_family(FAMILY, real_text(chars), QUICK_REPS if quick else REPS, cuda=cuda, cpu=not cuda)
    out: dict[str, Any] = {**row, "reps": QUICK_REPS if quick else REPS, "target_ms": GPU_TARGET_MS}
    if cuda:
        out["target_met"] = row["kernel_cuda_ms"] < GPU_TARGET_MS
    out["ok"] = bool(row["exact"])
    if not out["ok"]:
        out["error"] = f"TensorBpe ids differ from the {FAMILY} reference's on {chars:,} characters"
    return out
