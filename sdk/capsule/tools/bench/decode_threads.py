"""The decode suite's CPU engines x threads table: prefill tokens/s and decode ms/token at batch
1 and 4 for each LLM engine (``runtime={"llm_engines": [name]}``: torch, and onnxruntime when
it is installed) at 1 and 2 intra-op threads (``runtime={"threads": N}``), on CPU profiles only.

Why threads: on a small CPU that other processes share, the default thread count can be many
times slower than one thread (the threads wait on each other at every operator). Why engines:
the same steps on the same pool through torch's eager operators or one ONNX Runtime graph. Each
(engine, threads) cell is a fresh Session (both are read at open); the cells are interleaved
rep by rep so drift and the neighbours' load fall on all alike; an untimed warm-up of the same
shapes first (ORT builds its step sessions then). The load average at the start is recorded.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ...llm.engine_ort import missing_packages
from ...session import Session
from . import BenchOptions
from .timing import make_clock, percentile, progress, step_probe

THREADS = (1, 2)
ENGINES = ("torch", "onnxruntime")
BATCH = 4
PREFILL_TOKENS = 512
STEPS, QUICK_STEPS = 32, 8
REPS, QUICK_REPS = 3, 1
Prompt = Callable[[Any, int, int], str]


def _one(s: Session, rep: int, steps: int, prompt: Prompt) -> tuple[float, list[float], list[float]]:
    """(prefill seconds of a fresh PREFILL_TOKENS prompt, batch-1 decode step seconds, batch-4
    decode step seconds over four such streams)."""
    clock = make_clock(torch.device("cpu"))
    names = [f"threads-{rep}-{i}" for i in range(BATCH)]
    for i, name in enumerate(names):
        s.append(prompt(s.tokenizer, PREFILL_TOKENS, seed=rep * BATCH + i), stream=name)
    t0 = clock()
    s.generate(1, stream=names[0])
    prefill = clock() - t0
    with step_probe(s.engine.runner, clock, None) as samples:
        s.generate(steps + 1, stream=names[0])
    s.generate(1, stream=names[1:])                   # the other three prefilled, untimed
    with step_probe(s.engine.runner, clock, None) as batched:
        s.generate(steps + 1, stream=names)
    for name in names:
        s.drop_stream(name)
    return prefill, [dt for n, dt in samples if n == 1], [dt for n, dt in batched if n == BATCH]


def _engines() -> list[str]:
    return list(ENGINES) if missing_packages() is None else ["torch"]


def measure(opts: BenchOptions, prompt: Prompt, show: bool = True) -> dict[str, Any]:
    """One row per (engine, thread count); `cores` and `load_average` say what the machine
    offered."""
    steps = QUICK_STEPS if opts.quick else STEPS
    reps = QUICK_REPS if opts.quick else REPS
    counts = [t for t in THREADS if t <= (os.cpu_count() or 1)]
    cells = [(e, t) for e in _engines() for t in counts]
    before = torch.get_num_threads()   # the setting is process-wide: give it back afterwards
    got: dict[tuple[str, int], dict[str, list[float]]] = {
        c: {"prefill": [], "steps": [], "batched": []} for c in cells}
    bar = progress(len(cells) * (reps + 1), "engines x threads", show, unit="rep")
    try:
        with tempfile.TemporaryDirectory(prefix="capsule-bench-threads-") as tmp:
            sessions = {(e, t): Session.open(Path(tmp) / f"{e}-{t}", model=opts.model, device="cpu",
                                             runtime={"threads": t, "llm_engines": [e]})
                        for e, t in cells}
            try:
                for (e, t), s in sessions.items():    # untimed warm-up of the same shapes
                    torch.set_num_threads(t)
                    _one(s, -1, steps, prompt)
                    bar.update(1)
                for r in range(reps):
                    for c, s in sessions.items():
                        torch.set_num_threads(c[1])  # sessions share the process: set per turn
                        prefill, step, batched = _one(s, r, steps, prompt)
                        got[c]["prefill"].append(prefill)
                        got[c]["steps"] += step
                        got[c]["batched"] += batched
                        bar.update(1)
            finally:
                for s in sessions.values():
                    s.close()
    finally:
        torch.set_num_threads(before)
        bar.close()

    def p50_ms(v: list[float], per: int = 1) -> float | None:
        return percentile(v, 50) * 1e3 / per if v else None
    rows = [{"engine": e, "threads": t,
             "prefill_tokens": PREFILL_TOKENS,
             "prefill_tokens_per_s": PREFILL_TOKENS / statistics.median(g["prefill"]),
             # a trained model may end a reply early (EOS): fewer steps, or none, are timed then
             "decode_steps": len(g["steps"]),
             "decode_ms_p50": p50_ms(g["steps"]),
             "decode_ms_p99": percentile(g["steps"], 99) * 1e3 if g["steps"] else None,
             f"batch{BATCH}_ms_per_token_p50": p50_ms(g["batched"], BATCH),
             "decode_context": PREFILL_TOKENS}
            for (e, t), g in got.items()]
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
    title = (f"CPU engines x threads ({results['threads']['cores']} cores, load average "
             f"{'n/a' if load is None else f'{load:.2f}'} at the start)")
    tables[title] = results["threads"]["rows"]
