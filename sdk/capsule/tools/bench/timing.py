"""Timing helpers shared by suites: percentiles, a synchronizing clock, and a decode-step probe."""
from __future__ import annotations

import sys

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm import tqdm

from ...stats import percentile  # the runtime owns it (ControlLoop); suites import it from here

__all__ = ["make_clock", "percentile", "progress", "step_probe"]


def make_clock(device: torch.device) -> Callable[[], float]:
    """perf_counter that first waits for queued GPU work, so a reading covers the work before it."""
    if device.type == "cuda":
        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return clock
    return time.perf_counter


def announcer(suite: str, enabled: bool) -> Callable[[str], None]:
    """say(msg): one "suite: msg" line on stderr (when enabled), seen in logs where the bars
    are off (they are drawn only on a terminal)."""
    def say(msg: str) -> None:
        if enabled:
            print(f"{suite}: {msg}", file=sys.stderr, flush=True)
    return say


def progress(total: int, desc: str, enabled: bool, unit: str = "step") -> tqdm:
    # disable=None turns the bar off when stderr is not a terminal (CI logs, tests)
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None if enabled else True)


@contextmanager
def step_probe(runner: Any, clock: Callable[[], float], bar: tqdm | None = None,
               outputs: list[torch.Tensor] | None = None) -> Iterator[list[tuple[int, float]]]:
    """Time every `runner.decode(rows)` call made inside the block; yields [(rows, seconds), ...].

    The probe wraps the instance's bound method, so the engine's own decode loop is what is
    measured, and removes the wrapper on exit (the class method shows through again).
    outputs: when given, each step's logits are appended to it as a float32 host copy, after
    the step's time is taken (the copy is not timed; the returned view is overwritten next step).
    """
    samples: list[tuple[int, float]] = []
    inner = runner.decode

    def timed(rows: Sequence[Any]) -> torch.Tensor:
        t0 = clock()
        out = inner(rows)
        samples.append((len(rows), clock() - t0))
        if outputs is not None:
            outputs.append(out.detach().float().cpu())
        if bar is not None:
            bar.update(1)
        return out

    runner.decode = timed
    try:
        yield samples
    finally:
        del runner.decode
