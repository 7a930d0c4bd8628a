"""`capsule bench --suite tokenize`: incremental append latency vs full reference tokenization.

For the first registered family of each library (cl100k_base for tiktoken, deepseek-v4 for HF
tokenizers): a 100K / 1M / 3M-character context
of real text (installed packages' .py files, read in sorted order) is loaded with an untimed
``reset``; then 1.4K-character appends of the text that follows are timed one by one (p50/p99),
and a full ``reference.encode`` of the final text is timed in the same run (median of reps),
next to the same full encode by Gigatoken (``tokenize_baselines``; its ids are checked too).
After the run ``tok.ids == reference.encode(tok.text)`` is checked (the exactness column).
Timed runs use shadow_rate=0.0: no background shadow checks compete for the CPU.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from ...tokenize.differential import PACKAGES
from ...tokenize.incremental import IncrementalTokenizer
from ...tokenize.reference import load_reference
from ...tokenize.registry import all_families, get_family
from ...tokenize.sources import package_dir
from . import BenchOptions, SuiteResult
from .tokenize_baselines import Baseline, gigatoken_encoder, gigatoken_row
from .timing import percentile, progress

CONTEXTS, QUICK_CONTEXTS = (100_000, 1_000_000, 3_000_000), (100_000, 1_000_000)
APPENDS, QUICK_APPENDS = 20, 10
APPEND_CHARS = 1400
FULL_REPS, QUICK_FULL_REPS = 3, 2
TARGET_1M = {"tokenizers": 400.0, "tiktoken": 50.0}   # full encode / append p50 at 1M chars
TARGET_FLAT = 3.0   # "roughly flat": largest p50 / smallest p50 at most


def families() -> dict[str, str]:
    """Family name -> library: the first registered family of each library (one per engine)."""
    out: dict[str, str] = {}
    for fam in all_families():
        if fam.library not in out.values():
            out[fam.name] = fam.library
    return out


def real_text(n_chars: int) -> str:
    """The first n_chars characters of installed packages' .py files, concatenated in sorted order."""
    parts: list[str] = []
    total = 0
    for pkg in PACKAGES:
        root = package_dir(pkg)
        if root is None or not root.is_dir():
            continue
        for f in sorted(p for p in root.rglob("*.py") if p.is_file()):
            try:
                t = f.read_text("utf-8", errors="replace")
            except OSError:
                continue
            parts.append(t)
            total += len(t)
            if total >= n_chars:
                return "".join(parts)[:n_chars]
    text = "".join(parts)
    if not text:
        raise RuntimeError(f"no .py sources found in {PACKAGES} to build the benchmark text")
    return (text * (n_chars // len(text) + 1))[:n_chars]  # small installs: repeat what there is


def _one(family: str, ref: Any, corpus: str, ctx: int, appends: int, chars: int, reps: int,
         show: bool, baseline: Baseline) -> dict[str, Any]:
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    tok.reset(corpus[:ctx])  # untimed
    lat = []
    bar = progress(appends, f"{family} {ctx:,} chars", show, unit="append")
    for i in range(appends):
        piece = corpus[ctx + i * chars: ctx + (i + 1) * chars]
        t0 = time.perf_counter()
        tok.append(piece)
        lat.append(time.perf_counter() - t0)
        bar.update(1)
    bar.close()
    text = tok.text
    full = []
    for _ in range(reps):
        t0 = time.perf_counter()
        expect = ref.encode(text)
        full.append(time.perf_counter() - t0)
    p50, full_s = percentile(lat, 50), statistics.median(full)
    return {"family": family, "context_chars": ctx, "appends": appends, "append_chars": chars,
            "p50_ms": p50 * 1e3, "p99_ms": percentile(lat, 99) * 1e3, "full_encode_ms": full_s * 1e3,
            "ratio_full_over_p50": full_s / p50 if p50 > 0 else None,
            "final_chars": len(text), "final_tokens": tok.num_tokens,
            "exact": tok.ids == expect,
            "fallbacks": tok.stats["fallbacks"], "widenings": tok.stats["widenings"],
            **gigatoken_row(baseline, ref, text, p50, reps)}


def _targets(rows: list[dict[str, Any]], fams: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    by = {(r["family"], r["context_chars"]): r for r in rows}
    # each target is read at 1M characters (at 100K a full tiktoken encode is a few ms, so the
    # ratio there is in the main table but not a target)
    for fam, lib in fams.items():
        r, want = by.get((fam, 1_000_000)), TARGET_1M.get(lib)
        if r is not None and want is not None:
            v = r["ratio_full_over_p50"]
            out.append({"target": f"{fam} @1M chars: full {lib} / append p50 >= {want:.0f}x",
                        "measured": f"{v:.0f}x", "met": "yes" if v >= want else "NO"})
    for fam in fams:
        p = [(r["context_chars"], r["p50_ms"]) for r in rows if r["family"] == fam]
        if len(p) > 1:
            p.sort()
            spread = max(v for _, v in p) / min(v for _, v in p)
            out.append({"target": f"{fam}: p50 roughly flat {p[0][0]:,}..{p[-1][0]:,} chars (max/min <= 3)",
                        "measured": " / ".join(f"{v:.2f} ms" for _, v in p) + f" ({spread:.1f}x)",
                        "met": "yes" if spread <= TARGET_FLAT else "NO"})
    exact = all(r["exact"] for r in rows)
    out.append({"target": "exact: tok.ids == reference.encode(tok.text) after every run",
                "measured": str(exact), "met": "yes" if exact else "NO"})
    giga = [r["gigatoken_exact"] for r in rows if r["gigatoken_exact"] is not None]
    notes = sorted({r["gigatoken_note"] for r in rows if r["gigatoken_note"]})
    out.append({"target": "baseline: Gigatoken's ids == the reference's (else its times mean less)",
                "measured": str(all(giga)) if giga else "; ".join(notes),
                "met": ("yes" if all(giga) else "NO") if giga else "not measured"})
    return out


def run(opts: BenchOptions) -> SuiteResult:
    """Run the tokenize suite; opts.steps (if set) is the number of timed appends per context."""
    contexts = QUICK_CONTEXTS if opts.quick else CONTEXTS
    appends = opts.steps or (QUICK_APPENDS if opts.quick else APPENDS)
    reps = QUICK_FULL_REPS if opts.quick else FULL_REPS
    corpus = real_text(max(contexts) + appends * APPEND_CHARS)
    fams = families()
    settings = {"families": list(fams), "context_chars": list(contexts), "appends": appends,
                "append_chars": APPEND_CHARS, "full_encode_reps": reps, "shadow_rate": 0.0,
                "text": f"installed .py sources of {', '.join(PACKAGES)} in sorted order; "
                        "appends are the text following the context",
                "quick": opts.quick}
    rows = []
    for fam in fams:
        ref = load_reference(fam)
        ref.encode("warm up")  # builds a lazily loaded encoder outside the timings
        baseline = gigatoken_encoder(get_family(fam), ref.special_tokens)   # loaded once
        for ctx in contexts:
            rows.append(_one(fam, ref, corpus, ctx, appends, APPEND_CHARS, reps, opts.progress,
                             baseline))
    targets = _targets(rows, fams)
    results = {"runs": rows, "targets": targets, "exact": all(r["exact"] for r in rows)}
    table = [{k: r[k] for k in ("family", "context_chars", "p50_ms", "p99_ms", "full_encode_ms",
                                "ratio_full_over_p50", "gigatoken_full_ms",
                                "ratio_gigatoken_over_p50", "exact")} for r in rows]
    return SuiteResult(settings=settings, results=results,
                       tables={"append latency vs full encode": table, "targets": targets})
