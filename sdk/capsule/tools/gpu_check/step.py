"""One GPU-check step in this process: ``python -m capsule.tools.gpu_check.step NAME --device D
--result FILE [--quick] [--budget S]``. Writes the step's figures to FILE as strict JSON
(NaN / inf refused: a figure must be finite) and exits 0, or writes ``{"ok": false, "error":
...}`` and exits 1. CAPSULE_GPU_CHECK_FAIL=name,name makes those steps fail at once (to see
the report's failure path, and in the tests)."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from . import step_named

FAIL_ENV = "CAPSULE_GPU_CHECK_FAIL"


def run_one(name: str, device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    step = step_named(name)
    if name in os.environ.get(FAIL_ENV, "").split(","):
        raise RuntimeError(f"forced failure: {FAIL_ENV} names {name!r}")
    if device == "cpu":
        # one torch thread: the CPU run rehearses the check, often on a small shared CPU, where
        # more threads wait on each other at every operator (10x slower steps were seen)
        import torch
        torch.set_num_threads(1)
    figures = importlib.import_module(f"{__package__}.{step.module}").run(device, quick, budget_s)
    return {"ok": True, **figures} if "ok" not in figures else figures


def non_finite(doc: Any, path: str = "") -> list[str]:
    """The paths (a.b[2].c) of every float in doc that is NaN or infinite."""
    if isinstance(doc, float):
        return [] if math.isfinite(doc) else [path or "<root>"]
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(doc, (list, tuple)):
        return [p for i, v in enumerate(doc) for p in non_finite(v, f"{path}[{i}]")]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m capsule.tools.gpu_check.step")
    ap.add_argument("name")
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=60.0, help="the step's timeout, for inner limits")
    a = ap.parse_args(argv)
    try:
        doc = run_one(a.name, a.device, a.quick, a.budget)
        bad = non_finite(doc)
        if bad:
            raise ValueError(f"step {a.name} measured non-finite figures (NaN or inf): {', '.join(bad)}")
        text = json.dumps(doc, indent=1, allow_nan=False)
        rc = 0
    except BaseException as exc:  # noqa: BLE001 - any failure is this step's result, not a crash
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        doc = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-3000:]}
        text, rc = json.dumps(doc, indent=1), 1
    a.result.write_text(text + "\n", encoding="utf-8")
    return rc


if __name__ == "__main__":
    sys.exit(main())
