"""Decode step cost with a memory region: part of `capsule bench --suite memory`.

One stream (system + question, `DECODE_FACTS` facts injected) per region size; the same decode
row is stepped repeatedly (same token, same slot: idempotent), eagerly leaving out the region's
empty blocks and, for comparison, reading every block as a CUDA graph does. On a GPU with
graphs both numbers are the graph's (it always reads the static full table).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from ...session import Session
from . import BenchOptions
from .timing import make_clock

REGIONS = (None, 512, 2048)
DECODE_FACTS, DECODE_STEPS, DECODE_WARMUP = 5, 30, 10


def decode_rows(tmp: Path, opts: BenchOptions, runtime: dict, system: str, question: str,
                facts: list[str], say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    steps = 5 if opts.quick else DECODE_STEPS
    for region in REGIONS:
        memory = {"embedder": None} if region is None else {"embedder": None, "region_tokens": region}
        with Session.open(tmp / f"decode-{region}", model=opts.model, device=opts.device,
                          runtime=runtime, memory=memory) as s:
            for text in facts[:DECODE_FACTS]:
                s.remember(text)
            s.append(system, system=True)
            s.append(question)
            s.generate(1, memory_k=DECODE_FACTS if region else 0)
            engine = s.engine
            stream = engine.streams["main"]
            row = engine.next_row(stream)
            clock = make_clock(engine.pool.tensor.device)
            medians = {}
            for name, r in (("left_out", row), ("all", replace(row, skip=(0, 0)))):
                times = []
                with torch.inference_mode():
                    for i in range(DECODE_WARMUP + steps):
                        t0 = clock()
                        engine.runner.decode([r])
                        if i >= DECODE_WARMUP:
                            times.append(clock() - t0)
                medians[name] = statistics.median(times) * 1e3
            lo, hi = stream.table.skip
            rows.append({"region_tokens": region or 0, "facts": DECODE_FACTS if region else 0,
                         "context_positions": row.position + 1, "empty_region_blocks": max(0, hi - lo),
                         "step_ms": medians["left_out"], "step_ms_reading_all_blocks": medians["all"],
                         "graphs": engine.runner.uses_graphs})
            say(f"decode, region {region}: {medians['left_out']:.2f} ms/step "
                f"({medians['all']:.2f} reading every block)")
    return rows
