"""Restore to the first token in a fresh process, with and without torch (issue 19).

`prep` (once): a SmolLM2-135M Session on the onnxruntime LLM engine, one thread, prefills a
~2,000-token prompt, generates one token, checkpoints and writes the restore kit. Then, in
turns, fresh processes restore that capsule and produce the next token:
- "lite": ``capsule.lite.LiteResume`` (numpy + onnxruntime, torch never imported);
- "session": ``Session.open`` (torch, the whole Session) then ``generate(1)``.
Each child prints its phases (perf_counter is CLOCK_MONOTONIC: one clock for parent and
child, so spawn -> token includes the interpreter's start) and the token; the parent checks
both give the same token.

    .venv/bin/python bench/torchfree_first_token.py [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTEXT = 2000
RT = {"threads": 1, "llm_engines": ["onnxruntime"]}
WORDS = "the robot moves the red block to the left shelf and then checks the gripper ".split()


def prep(store: Path) -> int:
    from capsule import Session
    with Session.open(store, model="smollm2-135m", device="cpu", runtime=RT) as s:
        s.append(" ".join(WORDS[j % len(WORDS)] for j in range(int(CONTEXT * 0.85))))
        s.generate(1)
        s.checkpoint()
        s.write_lite_kit()
        return len(s.tokens())


def child(kind: str, store: str, t_start: float) -> None:
    t0 = time.perf_counter()
    if kind == "lite":
        from capsule.lite import LiteResume
        t_imp = time.perf_counter()
        r = LiteResume.open(store)
        t_open = time.perf_counter()
        tok = r.generate(1)[0]
    else:
        from capsule import Session
        t_imp = time.perf_counter()
        s = Session.open(store, model="smollm2-135m", device="cpu", runtime=RT)
        t_open = time.perf_counter()
        n0 = len(s.tokens())
        s.generate(1)
        tok = s.tokens()[n0]
    t_tok = time.perf_counter()
    print(json.dumps({"interpreter_ms": (t0 - t_start) * 1e3, "import_ms": (t_imp - t0) * 1e3,
                      "open_restore_ms": (t_open - t_imp) * 1e3, "first_token_ms": (t_tok - t_open) * 1e3,
                      "spawn_to_token_ms": (t_tok - t_start) * 1e3, "token": tok,
                      "torch_imported": "torch" in sys.modules}))
    os._exit(0)      # the figure is the token's; leave without the Session's close


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "s"
        n = prep(store)
        print(f"context: {n} tokens; load average {os.getloadavg()[0]:.2f}; cpu {os.cpu_count()}")
        runs: dict[str, list[dict]] = {"lite": [], "session": []}
        for _ in range(args.reps):          # interleaved: both see the same machine state
            for kind in runs:
                out = subprocess.run([sys.executable, __file__, "child", kind, str(store),
                                      repr(time.perf_counter())], capture_output=True, text=True, check=True)
                runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
        tokens = {r["token"] for rs in runs.values() for r in rs}
        for kind, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_ms")}
            print(f"{kind:8s} " + "  ".join(f"{k[:-3]} {v:.0f}" for k, v in med.items())
                  + f"  (ms, median of {len(rs)}; torch imported: {rs[0]['torch_imported']})")
        print(f"same token from every run: {len(tokens) == 1} ({sorted(tokens)})")


if __name__ == "__main__":
    main()
