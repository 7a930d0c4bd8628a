"""`capsule bench --suite tokenize-tails`: appends to a text that ends in one giant run.

The worst case of the splice rule: a long tail without a provable boundary (openai/harmony#151:
one 512 KiB run took 119 s to encode). For one family of each verified pipeline shape, three
tails of ``TAIL_KIB`` (a base64 blob, a digit run, a whitespace run) after a short prompt; then
``opts.steps`` appends of ``APPEND_CHARS`` chars that extend the run, each timed, the ids
checked against the reference after the last one. The first append is reported on its own
(``first_ms``: it builds the vocabulary's merge table and learns the long piece's ids with one
reference encode); p50/p99 are over the appends after it. The baseline is one full reference
encode of the same final text, timed in the same run (``ratio_full_over_p50``).
"""
from __future__ import annotations

import base64
import random
import statistics
import time
from typing import Any

from ...tokenize import IncrementalTokenizer, load_reference
from ...tokenize.registry import all_families
from . import BenchOptions, SuiteResult
from .timing import percentile

TAIL_KIB = 512
APPEND_CHARS = 100
DEFAULT_APPENDS, QUICK_APPENDS = 50, 8
CASE_BUDGET_S = 15.0    # stop a case's appends early once they took this long (whitespace runs)
TARGET_P99_MS = 5.0


def _tails(n: int, rng: random.Random) -> dict[str, str]:
    raw = bytes(rng.getrandbits(8) for _ in range(n * 3 // 4 + 3))
    return {"base64": base64.b64encode(raw).decode()[:n],
            "digits": "".join(rng.choice("0123456789") for _ in range(n)),
            "whitespace": " " * n}


def _one(family: str, kind: str, tail: str, appends: int) -> dict[str, Any]:
    ref = load_reference(family, prefetch=False)
    head = "user: here is the attachment:\n"
    body_end = len(tail) - appends * APPEND_CHARS
    tok = IncrementalTokenizer(ref, shadow_rate=0.0)
    tok.append(head + tail[:body_end])
    lat: list[float] = []
    spent = 0.0
    for i in range(body_end, len(tail), APPEND_CHARS):
        t0 = time.perf_counter()
        tok.append(tail[i:i + APPEND_CHARS])
        lat.append(time.perf_counter() - t0)
        spent += lat[-1]
        if spent > CASE_BUDGET_S:
            break
    text = tok.text
    t0 = time.perf_counter()
    want = ref.encode(text)
    full = time.perf_counter() - t0
    first, rest = lat[0], lat[1:] or lat   # the first append learns the long piece (warm-up)
    p50, p99 = statistics.median(rest), percentile(rest, 99)
    return {"family": family, "tail": kind, "tail_chars": len(text), "appends": len(lat),
            "first_ms": round(first * 1e3, 1),
            "p50_ms": round(p50 * 1e3, 3), "p99_ms": round(p99 * 1e3, 3),
            "full_encode_ms": round(full * 1e3, 1), "ratio_full_over_p50": round(full / p50, 1),
            "last_window_chars": tok.stats["last_window"], "exact": tok.ids == want,
            "p99_within_target": p99 * 1e3 <= TARGET_P99_MS}


def run(opts: BenchOptions) -> SuiteResult:
    appends = opts.steps or (QUICK_APPENDS if opts.quick else DEFAULT_APPENDS)
    shapes: dict[str, str] = {}
    for fam in all_families():   # the first family of each verified pipeline shape
        if fam.splice is not None and fam.splice not in shapes and fam.source_files():
            shapes[fam.splice] = fam.name
    n = (TAIL_KIB // (8 if opts.quick else 1)) * 1024
    tails = _tails(n, random.Random(0))
    settings = {"families": shapes, "tail_chars": n, "append_chars": APPEND_CHARS,
                "appends": appends, "case_budget_s": CASE_BUDGET_S, "target_p99_ms": TARGET_P99_MS,
                "quick": opts.quick}
    rows = []
    for shape, fam in shapes.items():
        for kind, tail in tails.items():
            row = _one(fam, kind, tail, appends)
            rows.append({"shape": shape, **row})
            if opts.progress:
                print(f"  {fam} {kind}: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, full "
                      f"{row['full_encode_ms']} ms, exact {row['exact']}", flush=True)
    results = {"runs": rows, "exact": all(r["exact"] for r in rows),
               "within_target": sorted({f"{r['family']}/{r['tail']}" for r in rows
                                        if r["p99_within_target"]})}
    return SuiteResult(settings=settings, results=results, tables={"appends to a giant tail": rows})
