"""Parts 2 and 3 of `capsule bench --suite capsules`: bytes per delta epoch, and the caller's stall.

Both look a little inside the Session (bench only): a probe around the snapshotter's
`capture` sees the dirty/live block sets and the host blobs an epoch was made from, and a
probe around the store's `sync` counts background group commits. Probes are instance
attributes removed on exit, like timing.step_probe.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ...session import Session
from ...store import PageStream
from .decode import robot_prompt
from .timing import percentile, progress

KV = "kv_pool"


@contextmanager
def capture_probe(snap: Any) -> Iterator[list[dict[str, int]]]:
    """Record, for every capture, the page bytes written per kind and the host state's full size."""
    seen: list[dict[str, int]] = []
    inner = snap.capture

    def probed(kv_dirty: set[int], kv_live: set[int], blobs: dict[str, bytes],
               stream: bool = False) -> Any:
        pages = inner(kv_dirty, kv_live, blobs, stream=stream)
        if isinstance(pages, PageStream):   # bytes not made yet: sizes from the keys
            pool = snap.registry[KV].tensor
            n_kv = sum(1 for r, _ in pages.keys if r == KV)
            kv_bytes = n_kv * pool[0].numel() * pool.element_size()
            other = pages.nbytes - kv_bytes
        else:
            n_kv = sum(1 for p in pages if p[0] == KV)
            kv_bytes = sum(len(p[2]) for p in pages if p[0] == KV)
            other = sum(len(p[2]) for p in pages if p[0] != KV)
        seen.append({"kv_pages": n_kv, "kv_page_bytes": kv_bytes, "other_page_bytes": other,
                     "host_bytes": sum(len(b) for b in blobs.values())})
        return pages

    snap.capture = probed
    try:
        yield seen
    finally:
        del snap.capture


@contextmanager
def sync_probe(store: Any) -> Iterator[list[int]]:
    """Epochs committed by each store.sync() (the background writer's group commit)."""
    counts: list[int] = []
    inner = store.sync

    def probed() -> list:
        infos = inner()
        if infos:
            counts.append(len(infos))
        return infos

    store.sync = probed
    try:
        yield counts
    finally:
        del store.sync


def measure_delta(s: Session, steps: int, new_tokens: int, show: bool) -> list[dict[str, Any]]:
    """`steps` x (generate(new_tokens), checkpoint()); one row of byte counts per epoch."""
    pool = s.registry[KV]
    bs = s.profile.runtime.block_size
    per_token = pool.page_bytes // bs
    regions = sum(r.tensor.numel() * r.tensor.element_size() for r in s.checkpointer.snap.saved_regions())
    table = s.engine.stream("main").table
    rows = []
    bar = progress(steps, f"delta epochs (+{new_tokens} tokens each)", show)
    with capture_probe(s.checkpointer.snap) as seen:
        for _ in range(steps):
            before = table.num_cached
            s.generate(new_tokens)
            s.checkpoint()
            after = table.num_cached
            cap, info = seen[-1], s.epochs()[-1]
            # the blocks these positions landed in: what a perfect delta must write for KV
            dirty_blocks = -(-after // bs) - before // bs
            dirty = dirty_blocks * pool.page_bytes + cap["other_page_bytes"]
            full = math.ceil(after / bs) * pool.page_bytes + regions + cap["host_bytes"]
            new_bytes = (after - before) * per_token
            rows.append({"epoch": info.id, "kv_tokens": after, "new_kv_tokens": after - before,
                         "bytes_written": info.bytes_written, "manifest_bytes": s.checkpointer.last_bytes
                         - cap["kv_page_bytes"] - cap["other_page_bytes"],
                         "kv_pages_written": cap["kv_pages"], "kv_pages_expected": dirty_blocks,
                         "other_page_bytes": cap["other_page_bytes"], "dirty_page_bytes": dirty,
                         "full_state_bytes": full, "new_token_bytes": new_bytes})
            bar.update(1)
    bar.close()
    return rows


def summarize_delta(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over epochs; each ratio is taken per epoch first, then its median."""
    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rows)
    return {"epochs": len(rows),
            "bytes_written_p50": med(lambda r: r["bytes_written"]),
            "full_state_bytes_p50": med(lambda r: r["full_state_bytes"]),
            "dirty_page_bytes_p50": med(lambda r: r["dirty_page_bytes"]),
            "new_token_bytes_p50": med(lambda r: r["new_token_bytes"]),
            "written_over_full_p50": med(lambda r: r["bytes_written"] / r["full_state_bytes"]),
            "write_amplification_p50": med(lambda r: r["bytes_written"] / r["dirty_page_bytes"]),
            "write_amplification_max": max(r["bytes_written"] / r["dirty_page_bytes"] for r in rows),
            "written_over_new_tokens_p50": med(lambda r: r["bytes_written"] / r["new_token_bytes"]),
            "full_save_over_written_p50": med(lambda r: r["full_state_bytes"] / r["bytes_written"]),
            "extra_kv_pages": sum(max(0, r["kv_pages_written"] - r["kv_pages_expected"]) for r in rows),
            "missing_kv_pages": sum(max(0, r["kv_pages_expected"] - r["kv_pages_written"]) for r in rows)}


def control_loop(store: Path, device: str, steps: int, checkpoints: bool, period: float,
                 warmup: int, show: bool) -> dict[str, Any]:
    """builtin:tiny at a fixed rate: generate(1) (+ checkpoint(wait=False)) per tick, deadline-scheduled."""
    with Session.open(store, model="builtin:tiny", device=device,
                      runtime={"kv_pool_mb": 8, "max_context": 1024}) as s:
        s.append(robot_prompt(s.tokenizer, 64, seed=7))
        for _ in range(warmup):  # same shape as a timed step; the first (full) capsule goes here
            s.generate(1)
            if checkpoints:
                s.checkpoint(wait=False)
        s.flush()
        work, stall, misses = [], [], 0
        bar = progress(steps, f"100 Hz loop, checkpoints {'on' if checkpoints else 'off'}", show)
        with sync_probe(s.store) as syncs:
            tick = time.perf_counter()
            for _ in range(steps):
                t0 = time.perf_counter()
                s.generate(1)
                if checkpoints:
                    c0 = time.perf_counter()
                    last = s.checkpoint(wait=False)
                    stall.append(time.perf_counter() - c0)
                t1 = time.perf_counter()
                work.append(t1 - t0)
                tick += period
                if t1 > tick:  # missed: the next step starts at the next tick still ahead
                    misses += 1
                    tick += period * math.floor((t1 - tick) / period)
                else:
                    time.sleep(max(0.0, tick - time.perf_counter()))
                bar.update(1)
            bar.close()
            s.flush()  # not timed: makes every staged epoch durable
        newest_durable = s.epochs()[-1].id if checkpoints else None
        out: dict[str, Any] = {"checkpoints": checkpoints, "steps": steps,
                               "work_p50_ms": percentile(work, 50) * 1e3, "work_p99_ms": percentile(work, 99) * 1e3,
                               "work_max_ms": max(work) * 1e3, "deadline_misses": misses,
                               "work_ms": [w * 1e3 for w in work]}      # every step, for the histogram
        if checkpoints:
            out.update({"stall_p50_ms": percentile(stall, 50) * 1e3, "stall_p99_ms": percentile(stall, 99) * 1e3,
                        "stall_max_ms": max(stall) * 1e3, "epochs_committed": sum(syncs),
                        "last_epoch_durable": newest_durable == last, "sync_calls": len(syncs),
                        "epochs_per_sync": sum(syncs) / len(syncs) if syncs else None})
    return out
