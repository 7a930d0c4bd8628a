"""`capsule bench --suite tokenize-diff`: the differential campaign over every registered family.

Each check is one append or tail replacement compared with the reference on the full text
(``run_differential``); any divergence comes back with a reproducer (source, seam, text hash,
tail). opts.steps sets the checks per family (default 250,000; --quick 5,000). Every stream's
whole text is also encoded by the tensor BPE kernel (``edge_kernels.bpe``) and compared.
"""
from __future__ import annotations

from typing import Any

from ...tokenize.differential import run_differential
from ...tokenize.registry import family_names
from . import BenchOptions, SuiteResult

DEFAULT_CHECKS, QUICK_CHECKS = 250_000, 5_000
SEED = 0


def run(opts: BenchOptions) -> SuiteResult:
    n = opts.steps or (QUICK_CHECKS if opts.quick else DEFAULT_CHECKS)
    names = family_names()
    settings = {"families": list(names), "checks_per_family": n, "seed": SEED, "max_chars": 3000,
                "check": "tok.ids == reference.encode(tok.text) after every append/replace_tail",
                "bpe_check": "TensorBpe(ref).encode_batch(texts) == reference.encode(text) for every "
                             "stream's whole text (64 texts per kernel pass, CPU tensors)",
                "quick": opts.quick}
    families: dict[str, Any] = {}
    divergences: list[dict[str, Any]] = []
    for fam in names:  # one family per call, so a line per family is printed as it finishes
        out = run_differential([fam], n_checks=n, seed=SEED, bpe=True)
        families[fam] = out["families"][fam]
        divergences += out["divergences"]
        if opts.progress:
            f = families[fam]
            print(f"  {fam}: {f['checks']:,} checks, {f['divergences']} divergences; tensor BPE "
                  f"{f['bpe_checks']:,} texts, {f['bpe_divergences']} divergences ({f['seconds']} s)",
                  flush=True)
    rows = [{"family": fam, **f} for fam, f in families.items()]
    total = {"family": "total", "checks": sum(f["checks"] for f in families.values()),
             "divergences": sum(f["divergences"] for f in families.values()),
             "streams": sum(f["streams"] for f in families.values()),
             "bpe_checks": sum(f["bpe_checks"] for f in families.values()),
             "bpe_divergences": sum(f["bpe_divergences"] for f in families.values()),
             "seconds": round(sum(f["seconds"] for f in families.values()), 2)}
    results = {"families": families, "total": total, "divergences": divergences}
    tables = {"differential checks": rows + [total]}
    if divergences:
        tables["divergences"] = [{k: d[k] for k in ("family", "source", "seam", "chars", "text_sha256")}
                                 for d in divergences[:20]]
    return SuiteResult(settings=settings, results=results, tables=tables)
