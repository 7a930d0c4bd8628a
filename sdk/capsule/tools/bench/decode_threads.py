"""The decode suite's CPU-threads line: prefill tokens/s and batch-1 decode ms/token at 1 and 2
torch intra-op threads (``runtime={"threads": N}``), on CPU profiles only.

Why: on a small CPU that other processes share, the default thread count can be many times
slower than one thread (the threads wait on each other at every operator). Each thread count is
a fresh Session (the setting is read at open); the counts are interleaved rep by rep so drift
and the neighbours' load fall on both alike. The load average at the start is recorded.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ...session import Session
from . import BenchOptions
from .timing import make_clock, percentile, progress, step_probe

THREADS = (1, 2)
PREFILL_TOKENS = 512
STEPS, QUICK_STEPS = 32, 8
REPS, QUICK_REPS = 3, 1
Prompt = Callable[[Any, int, int], str]


def _one(s: Session, rep: int, steps: int, prompt: Prompt) -> tuple[float, list[float]]:
    """(prefill seconds of a fresh PREFILL_TOKENS prompt, batch-1 decode step seconds)."""
    clock = make_clock(torch.device("cpu"))
    name = f"threads-{rep}"
    s.append(prompt(s.tokenizer, PREFILL_TOKENS, seed=rep), stream=name)
    t0 = clock()
    s.generate(1, stream=name)
    prefill = clock() - t0
    with step_probe(s.engine.runner, clock, None) as samples:
        s.generate(steps + 1, stream=name)
    s.drop_stream(name)
    return prefill, [dt for n, dt in samples if n == 1]


def measure(opts: BenchOptions, prompt: Prompt, show: bool = True) -> dict[str, Any]:
    """One row per thread count; `cores` and `load_average` say what the machine offered."""
    steps = QUICK_STEPS if opts.quick else STEPS
    reps = QUICK_REPS if opts.quick else REPS
    counts = [t for t in THREADS if t <= (os.cpu_count() or 1)]
    before = torch.get_num_threads()   # the setting is process-wide: give it back afterwards
    got: dict[int, dict[str, list[float]]] = {t: {"prefill": [], "steps": []} for t in counts}
    bar = progress(len(counts) * (reps + 1), "threads", show, unit="rep")
    try:
        with tempfile.TemporaryDirectory(prefix="capsule-bench-threads-") as tmp:
            sessions = {t: Session.open(Path(tmp) / f"t{t}", model=opts.model, device="cpu",
                                        runtime={"threads": t}) for t in counts}
            try:
                for t, s in sessions.items():    # untimed warm-up of the same shapes
                    torch.set_num_threads(t)
                    _one(s, -1, 2, prompt)
                    bar.update(1)
                for r in range(reps):
                    for t, s in sessions.items():
                        torch.set_num_threads(t)  # sessions share the process: set per turn
                        prefill, step = _one(s, r, steps, prompt)
                        got[t]["prefill"].append(prefill)
                        got[t]["steps"] += step
                        bar.update(1)
            finally:
                for s in sessions.values():
                    s.close()
    finally:
        torch.set_num_threads(before)
        bar.close()
    rows = [{"threads": t,
             "prefill_tokens": PREFILL_TOKENS,
             "prefill_tokens_per_s": PREFILL_TOKENS / statistics.median(g["prefill"]),
             # a trained model may end a reply early (EOS): fewer steps, or none, are timed then
             "decode_steps": len(g["steps"]),
             "decode_ms_p50": percentile(g["steps"], 50) * 1e3 if g["steps"] else None,
             "decode_ms_p99": percentile(g["steps"], 99) * 1e3 if g["steps"] else None,
             "decode_context": PREFILL_TOKENS}
            for t, g in got.items()]
    return {"rows": rows, "cores": os.cpu_count(), "load_average_1m": _load(), "reps": reps,
            "steps": steps}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:   # not offered on this platform
        return None


def report(opts: BenchOptions, results: dict[str, Any], tables: dict[str, list[dict[str, Any]]],
           device: torch.device, prompt: Prompt) -> None:
    """The decode suite's hook: on CPU, the thread-count measurement into its results and tables.
    prompt: the suite's prompt maker (tokenizer, n_tokens, seed) -> text."""
    if device.type != "cpu":
        return
    results["threads"] = measure(opts, prompt, opts.progress)
    load = results["threads"]["load_average_1m"]
    title = (f"CPU threads ({results['threads']['cores']} cores, load average "
             f"{'n/a' if load is None else f'{load:.2f}'} at the start)")
    tables[title] = results["threads"]["rows"]
