"""The decode suite's Session-level append line: `Session.append` of 1.4K characters, and the
host bytes of the checkpoint right after it, from 1K tokens of history to the largest history
the profile's `max_context` leaves room for.

What it shows (docs/FORMAT.md, "What a Session capsule holds"): an append costs what it adds,
not the history (p50 flat within 1.5x across history sizes), and the checkpoint after it writes
about the new text's and ids' bytes (within 2x, plus a constant: the manifest and the partly
filled last page of each host blob it touches). Only the public Session API is used: each rep
is a fresh stream (history appended and checkpointed untimed), one timed append, one
checkpoint; the constant is measured as the bytes of a checkpoint with nothing changed.
"""
from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ...session import Session
from ...state.snapshot import HOST_PAGE
from . import BenchOptions
from .timing import make_clock, progress

APPEND_CHARS = 1400
HISTORY_TOKENS = (1024, 2048)            # and the largest that leaves room for one append
REPS, QUICK_REPS = 21, 7
WARMUP_REPS = 2
# one name for every rep: a new name per rep would grow each epoch record with the keys of
# streams dropped before (the store names every record an epoch's view references)
STREAM = "append-bench"


def _lines(rng: random.Random) -> str:
    words = ("move", "grasp", "the", "red cup", "to", "bin", "slowly", "joint", "torque", "ok")
    return (f"user: {' '.join(rng.choice(words) for _ in range(rng.randint(3, 9)))} "
            f"({rng.randint(1, 999)} mm, {rng.uniform(-3, 3):.2f} rad)\n")


def append_text(seed: int, n_chars: int = APPEND_CHARS) -> str:
    """n_chars of robot-log-like text (a new turn), reproducible per seed."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        out.append(_lines(rng))
        size += len(out[-1])
    return "".join(out)[:n_chars]


def _history(tokenizer: Any, n_tokens: int, seed: int) -> str:
    """Whole lines of the same log, just at least n_tokens tokens of it."""
    rng = random.Random(-1 - seed)
    lines: list[str] = []
    while len(tokenizer.encode("".join(lines))) < n_tokens:
        lines += [_lines(rng) for _ in range(32)]
    while len(lines) > 1 and len(tokenizer.encode("".join(lines[:-1]))) >= n_tokens:
        lines.pop()
    return "".join(lines)


def _one(s: Session, history: str, text: str, clock: Callable[[], float]) -> dict[str, Any]:
    """A fresh stream holding `history` (checkpointed, untimed), then the timed append and the
    checkpoint after it."""
    name = STREAM
    s.append(history, stream=name)
    s.checkpoint()                                     # the history is in the store now
    s.checkpoint()
    constant = s.epochs()[-1].bytes_written            # nothing changed: manifest and records
    before = len(s.tokens(name))
    t0 = clock()
    s.append(text, stream=name)
    dt = clock() - t0
    s.checkpoint()
    written = s.epochs()[-1].bytes_written
    new_ids = len(s.tokens(name)) - before
    new_bytes = len(text.encode("utf-8")) + 4 * max(0, new_ids)
    s.drop_stream(name)
    s.checkpoint()                                     # the next rep starts from no stream
    return {"append_s": dt, "written": written, "constant": constant, "new_bytes": new_bytes,
            "history": before}


def measure(opts: BenchOptions, show: bool = True, max_context: int | None = None) -> dict[str, Any]:
    """One row per history size, and the flatness / byte-bound checks over them. max_context:
    a runtime override (default: the profile's)."""
    reps = QUICK_REPS if opts.quick else REPS
    runtime = {"max_context": max_context} if max_context else None
    with tempfile.TemporaryDirectory(prefix="capsule-bench-append-") as tmp:
        with Session.open(Path(tmp) / "append", model=opts.model, device=opts.device,
                          runtime=runtime) as s:
            clock = make_clock(torch.device("cuda" if s.profile.device == "cuda" else "cpu"))
            most = s.profile.runtime.max_context
            largest = most - len(s.tokenizer.encode(append_text(0))) - 64   # room for one append
            sizes = sorted({n for n in HISTORY_TOKENS if n < largest} | {largest})
            histories = {n: _history(s.tokenizer, n, seed=n) for n in sizes}
            for w in range(WARMUP_REPS):              # untimed: encoder, first capsule, caches
                _one(s, histories[sizes[0]], append_text(1000 + w), clock)
            got: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
            bar = progress(len(sizes) * reps, "Session.append", show, unit="append")
            for r in range(reps):                     # sizes interleaved: drift falls on all alike
                for n in sizes:
                    got[n].append(_one(s, histories[n], append_text(r), clock))
                    bar.update(1)
            bar.close()
    rows = [_row(got[n]) for n in sizes]
    p50s = [r["append_ms_p50"] for r in rows]
    return {"rows": rows, "max_context": most, "append_chars": APPEND_CHARS, "reps": reps,
            "append_p50_largest_over_smallest": p50s[-1] / p50s[0],
            "append_p50_within_1_5x": max(p50s) <= 1.5 * min(p50s),
            "checkpoint_within_2x_new_plus_constant": all(r["bound_ok"] for r in rows)}


def _row(got: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    return {"history_tokens": int(med(g["history"] for g in got)),
            "append_ms_p50": med(g["append_s"] for g in got) * 1e3,
            "append_ms_max": max(g["append_s"] for g in got) * 1e3,
            "new_bytes_p50": med(g["new_bytes"] for g in got),
            "checkpoint_bytes_p50": med(g["written"] for g in got),
            "manifest_bytes_p50": med(g["constant"] for g in got),
            "host_over_new_p50": med((g["written"] - g["constant"]) / g["new_bytes"] for g in got),
            # the bound, per rep: written <= 2 x new + the manifest + the rewritten old part of
            # the last page of the text and the ids blobs (pages are 4 KiB)
            "bound_ok": all(g["written"] <= 2 * g["new_bytes"] + g["constant"] + 2 * HOST_PAGE
                            for g in got)}


def report(opts: BenchOptions, results: dict[str, Any], tables: dict[str, list[dict[str, Any]]]) -> None:
    """The decode suite's hook: add the append measurement to its results and tables."""
    results["append"] = measure(opts, opts.progress)
    tables[f"Session.append ({APPEND_CHARS} chars) and the checkpoint after it"] = results["append"]["rows"]
