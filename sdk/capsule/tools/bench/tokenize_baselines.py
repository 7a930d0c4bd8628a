"""Full-encode baselines beside each family's reference in `capsule bench --suite tokenize`.

Gigatoken (a fast exact Rust tokenizer on PyPI, installed ``--no-deps`` by ``make``: its
declared awkward/typer are only for its batch arrays and CLI) encodes the same vocabulary: a
tiktoken rank file with the family's regex scheme, or the family's tokenizer.json. It caches
identical inputs, so each rep encodes a different text (the context plus a rep number).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

from ...tokenize.packaged import read_vocab_json
from ...tokenize.registry import Family

Encode = Callable[[str], list[int]]
Baseline = tuple[Optional[Encode], str]   # (encode, "") or (None, why not)
# splice rule -> gigatoken's name for that regex scheme (tiktoken rank files carry none)
GIGATOKEN_SCHEMES = {"cl100k-pattern": "cl100k", "r50k-pattern": "r50k", "o200k-pattern": "o200k",
                     "qwen2-pattern": "qwen2", "qwen3.5-pattern": "qwen35"}


def gigatoken_encoder(fam: Family, special_tokens: dict[str, int]) -> Baseline:
    """(encode, "") for the family's vocabulary through gigatoken, or (None, why not)."""
    try:
        import gigatoken
    except ImportError:
        return None, "gigatoken is not installed (pip install --no-deps gigatoken)"
    files = fam.source_files()
    if not files:
        return None, f"{fam.name}: vocabulary not installed"
    try:
        if fam.library == "tiktoken":
            scheme = GIGATOKEN_SCHEMES.get(fam.splice or "")
            if scheme is None:
                return None, f"{fam.name}: no gigatoken scheme for {fam.splice}"
            tok = gigatoken.Tokenizer.from_tiktoken(files[0], pretokenizer=scheme,
                                                    special_tokens=dict(special_tokens))
        else:
            tok = gigatoken.Tokenizer.from_json(read_vocab_json(files[0]))
    except Exception as exc:   # gigatoken's loaders raise ValueError or its own errors
        return None, f"gigatoken cannot load {fam.name}: {exc}"
    return (lambda text: tok.encode(text).tolist()), ""


def time_full(encode: Encode, text: str, reps: int) -> float:
    """Median seconds of a full encode; rep i encodes ``text`` plus a marker of its own."""
    times = []
    for i in range(reps):
        varied = f"{text}\n# rep {i}\n"
        t0 = time.perf_counter()
        encode(varied)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gigatoken_row(baseline: Baseline, ref: Any, text: str, p50_s: float, reps: int
                  ) -> dict[str, Any]:
    """The gigatoken columns of one run (``baseline`` from ``gigatoken_encoder``): full encode,
    ratio to the append p50, exactness."""
    encode, why = baseline
    if encode is None:
        return {"gigatoken_full_ms": None, "ratio_gigatoken_over_p50": None,
                "gigatoken_exact": None, "gigatoken_note": why}
    full_s = time_full(encode, text, reps)
    return {"gigatoken_full_ms": full_s * 1e3,
            "ratio_gigatoken_over_p50": full_s / p50_s if p50_s > 0 else None,
            "gigatoken_exact": encode(text) == ref.encode(text), "gigatoken_note": ""}
