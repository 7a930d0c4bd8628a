"""Restore -> first token with ``capsule.lite`` (no torch), in fresh processes (issue 19).

``measure_lite(text, ...)``: a Session (one thread; on the onnxruntime LLM engine for the
dequantized model, on the C step for ``kind="dequantized-c"`` and ``"int4"``: RUNTIMES) appends the transcript, generates
one token, checkpoints and writes the restore kit; its next greedy token is the reference. Then each rep spawns a process that imports only ``capsule.lite``,
opens the store and generates one token; it reports its phases against the parent's clock
(perf_counter is CLOCK_MONOTONIC: one clock for both, so spawn -> token includes the
interpreter's start) and whether torch was imported.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .child_env import timed_child_env

# the Session that writes each kit, by kind: onnxruntime graphs (dequantized), the dense fp32 C
# step (dequantized-c: the default CPU Session) or the int4 C step
RUNTIMES = {"dequantized": {"threads": 1, "llm_engines": ["onnxruntime"]}, "dequantized-c": {"threads": 1},
            "int4": {"threads": 1, "linears": "int4"}}

CHILD = """
import json, os, sys, time
t0 = time.perf_counter()
from capsule.lite import LiteResume
t1 = time.perf_counter()
r = LiteResume.open(sys.argv[1])
t2 = time.perf_counter()
token = r.generate(1)[0]
t3 = time.perf_counter()
start = float(sys.argv[2])
print(json.dumps({"interpreter_s": t0 - start, "import_s": t1 - t0, "open_s": t2 - t1, "first_token_s": t3 - t2,
                  "process_s": t3 - start, "token": token, "torch_imported": "torch" in sys.modules}))
sys.stdout.flush()
os._exit(0)
"""


def prepare(text: str, model: str, store: Path, kind: str = "dequantized") -> tuple[int, int, int]:
    """(context tokens, the Session's next token, epoch bytes) of a store holding ``text`` plus
    one generated token, with its restore kit."""
    from ...session import Session
    with Session.open(store, model=model, device="cpu", runtime=RUNTIMES[kind]) as s:
        s.append(text)
        s.generate(1)
        s.checkpoint()
        s.write_lite_kit()
        n = len(s.tokens())
        s.generate(1)              # what a Session restored from that capsule would pick
        return n, s.tokens()[n], s.checkpointer.last_bytes


def measure_lite(text: str, model: str, reps: int, work: Path, kind: str = "dequantized") -> dict[str, Any]:
    """Medians over ``reps`` fresh processes (seconds, after one uncounted warm-up), and whether
    each gave the Session's token."""
    store = work / ("lite" if kind == "dequantized" else f"lite-{kind}")
    n, want, nbytes = prepare(text, model, store, kind)
    runs = []
    for rep in range(reps + 1):       # the first run warms the bytecode cache (child_env): not counted
        out = subprocess.run([sys.executable, "-c", CHILD, str(store), repr(time.perf_counter())],
                             capture_output=True, text=True, timeout=600, env=timed_child_env())
        if out.returncode != 0:
            raise RuntimeError(f"the lite restore child failed: {out.stderr[-1500:]}")
        if rep:
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    row: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in
                           ("interpreter_s", "import_s", "open_s", "first_token_s", "process_s")}
    row.update(context_tokens=n, state_bytes=nbytes, reps=reps,
               token_as_session=all(r["token"] == want for r in runs),
               torch_imported=any(r["torch_imported"] for r in runs),
               process_runs_s=[r["process_s"] for r in runs])
    return row
