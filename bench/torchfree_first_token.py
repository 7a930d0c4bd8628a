"""Restore to the first token in a fresh process, with and without torch (issue 19).

Once (``capsule.tools.bench.lite_restore.prepare``): a SmolLM2-135M Session of ``--kind``
(lite_restore.RUNTIMES: "dequantized-c", the default CPU Session decoding in the C step;
"dequantized", on the onnxruntime LLM engine; "int4"), one thread, prefills a ~2,000-token prompt,
generates one token, checkpoints, writes the restore kit and notes its own next token. Then, in
turns, fresh processes restore that capsule and produce the next token (bytecode cached, as an
installed package: child_env):
- "lite": ``capsule.lite.LiteResume`` (numpy + the C kernels or onnxruntime, never torch);
- "session": ``Session.open`` (torch, the whole Session) then ``generate(1)``.
Each child prints its phases (perf_counter is CLOCK_MONOTONIC: one clock for parent and
child, so spawn -> token includes the interpreter's start) and the token; the parent checks
each is the Session's. (``capsule bench --suite peers`` runs the lite child beside llama.cpp.)

    .venv/bin/python bench/torchfree_first_token.py [--reps 5] [--kind dequantized-c]
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

from capsule.tools.bench.child_env import timed_child_env
from capsule.tools.bench.lite_restore import CHILD, RUNTIMES, prepare

CONTEXT = 2000
WORDS = "the robot moves the red block to the left shelf and then checks the gripper ".split()


def session_child(store: str, kind: str, t_start: float) -> None:
    t0 = time.perf_counter()
    from capsule import Session
    t1 = time.perf_counter()
    s = Session.open(store, model="smollm2-135m", device="cpu", runtime=RUNTIMES[kind])
    t2 = time.perf_counter()
    n0 = len(s.tokens())
    s.generate(1)
    t3 = time.perf_counter()
    print(json.dumps({"interpreter_s": t0 - t_start, "import_s": t1 - t0, "open_s": t2 - t1,
                      "first_token_s": t3 - t2, "process_s": t3 - t_start, "token": s.tokens()[n0],
                      "torch_imported": "torch" in sys.modules}))
    sys.stdout.flush()
    os._exit(0)      # the figure is the token's; leave without the Session's close


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        session_child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kind", choices=sorted(RUNTIMES), default="dequantized-c")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "s"
        text = " ".join(WORDS[j % len(WORDS)] for j in range(int(CONTEXT * 0.85)))
        n, want, _ = prepare(text, "smollm2-135m", store, args.kind)
        print(f"context: {n} tokens; load average {os.getloadavg()[0]:.2f}; cpu {os.cpu_count()}")
        runs: dict[str, list[dict]] = {"lite": [], "session": []}
        # interleaved: both see the same machine state; rep 0 warms the bytecode cache (not counted)
        for rep in range(args.reps + 1):
            for kind, argv in (("lite", ["-c", CHILD, str(store)]),
                               ("session", [__file__, "child", str(store), args.kind])):
                out = subprocess.run([sys.executable, *argv, repr(time.perf_counter())],
                                     capture_output=True, text=True, check=True, env=timed_child_env())
                if rep:
                    runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for kind, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) * 1e3 for k in rs[0] if k.endswith("_s")}
            print(f"{kind:8s} " + "  ".join(f"{k[:-2]} {v:.0f}" for k, v in med.items())
                  + f"  (ms, median of {len(rs)}; torch imported: {rs[0]['torch_imported']})")
        print(f"every run gave the Session's next token: {all(r['token'] == want for rs in runs.values() for r in rs)}")


if __name__ == "__main__":
    main()
