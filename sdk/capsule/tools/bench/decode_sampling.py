"""The decode suite's sampling line: the decode step at batch 4, greedy vs temperature 0.8 +
top-p 0.9, in one run.

A step here is the whole engine step, from one `runner.decode` call to the next: the decode,
the sampler over its logits and the engine's host bookkeeping, so the sampler's cost is inside
the number (the suite's step probe times `runner.decode` alone). Greedy and sampled reps
alternate (greedy first in even reps, sampled first in odd ones) so drift (heat, context
growth, other load) falls on both alike; one untimed rep of each comes first. The target: the
sampled p50 within 1.1x of the greedy p50.
"""
from __future__ import annotations

import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ...session import Session
from . import BenchOptions
from .timing import make_clock, percentile, progress

BATCH = 4
CONTEXT = 128                        # prompt tokens per stream before the timed steps
STEPS, QUICK_STEPS = 16, 8           # decode steps per rep (short reps: fine interleaving)
REPS, QUICK_REPS = 20, 4             # timed reps per mode, after one warm-up rep of each
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
MODES: dict[str, dict[str, float]] = {"greedy": {}, "temperature 0.8, top-p 0.9": SAMPLED}
TARGET = 1.1                         # sampled p50 / greedy p50


def _prompt(tokenizer: Any, n_tokens: int, seed: int) -> str:
    """Whole lines of a robot-log-like transcript, at least n_tokens tokens, per seed."""
    rng = random.Random(seed)
    lines: list[str] = []
    while len(tokenizer.encode("".join(lines))) < n_tokens:
        lines += [f"t={rng.randint(0, 99999):05d} joint{rng.randint(1, 7)}={rng.uniform(-3, 3):.3f} "
                  f"user: grasp the {rng.choice(('red cup', 'blue box', 'door'))}\n" for _ in range(8)]
    return "".join(lines)


@contextmanager
def _step_starts(runner: Any, clock: Callable[[], float]) -> Iterator[list[tuple[int, float]]]:
    """Record (rows, clock()) at the entry of every runner.decode call made inside the block."""
    marks: list[tuple[int, float]] = []
    inner = runner.decode

    def marked(rows: Sequence[Any]) -> torch.Tensor:
        marks.append((len(rows), clock()))
        return inner(rows)

    runner.decode = marked
    try:
        yield marks
    finally:
        del runner.decode           # the class method shows through again


def _steps(marks: list[tuple[int, float]], batch: int) -> list[float]:
    """Seconds between consecutive decode entries while all `batch` streams were decoding."""
    return [t1 - t0 for (n0, t0), (n1, t1) in zip(marks, marks[1:]) if n0 == n1 == batch]


def sampling_rows(s: Session, runner: Any, quick: bool, show: bool = False,
                  batch: int = BATCH) -> list[dict[str, Any]]:
    """p50/p99 engine step (decode + sample) at `batch` streams, greedy vs sampled, interleaved."""
    steps, reps = (QUICK_STEPS, QUICK_REPS) if quick else (STEPS, REPS)
    clock = make_clock(runner.pool.tensor.device)
    names = [f"sampling-b{batch}-{i}" for i in range(batch)]
    for i, name in enumerate(names):
        s.append(_prompt(s.tokenizer, CONTEXT, 200 + i), stream=name)
    order = list(MODES)
    times: dict[str, list[float]] = {m: [] for m in order}
    bar = progress(2 * (reps + 1), f"decode sampling batch {batch}", show, unit="rep")
    for rep in range(reps + 1):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            kw = MODES[mode]
            with _step_starts(runner, clock) as marks:
                s.generate(steps + 1, stream=names, seed=rep if kw else None, **kw)
            if rep:                                        # rep 0: the warm-up of both modes
                times[mode] += _steps(marks, batch)
            bar.update(1)
    bar.close()
    for name in names:
        s.drop_stream(name)
    base = percentile(times["greedy"], 50) if times["greedy"] else None
    rows = []
    for mode in order:
        lat = times[mode]
        p50 = percentile(lat, 50) if lat else None
        rows.append({"batch": batch, "mode": mode, "steps": len(lat),
                     "p50_ms": p50 * 1e3 if p50 is not None else None,
                     "p99_ms": percentile(lat, 99) * 1e3 if lat else None,
                     "vs_greedy": p50 / base if p50 is not None and base else None,
                     "target": f"<= {TARGET}x greedy" if MODES[mode] else "-"})
    return rows


def measure(opts: BenchOptions) -> list[dict[str, Any]]:
    """Open a Session of opts.model on opts.device and measure; [] if batch 4 is not a bucket."""
    with tempfile.TemporaryDirectory(prefix="capsule-bench-sampling-") as tmp, \
            Session.open(Path(tmp) / "s", model=opts.model, device=opts.device) as s:
        runner = s.engine.runner  # bench-only look inside: the probe wraps its decode call
        if runner.buckets[-1] < BATCH:
            return []
        return sampling_rows(s, runner, opts.quick, opts.progress)


def report(opts: BenchOptions, results: dict[str, Any], tables: dict[str, list[dict[str, Any]]]) -> None:
    """The decode suite's hook: add the sampling measurement to its results and tables."""
    results["sampling"] = measure(opts)
    tables[f"decode step with sampling, batch {BATCH} (decode + sampler, interleaved)"] = results["sampling"]
