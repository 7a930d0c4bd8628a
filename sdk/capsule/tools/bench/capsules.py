"""`capsule bench --suite capsules`: what durable delta capsules cost and buy, against same-run baselines.

1. restore-to-first-token in a fresh process vs the cold path (tokenize + prefill), 1K-8K tokens;
2. bytes written per epoch while a conversation grows 8 tokens a step, vs a full-state save;
3. the caller's stall from checkpoint(wait=False) every step of a 100 Hz loop;
4. restore read throughput vs this disk's sequential read bandwidth; fsync latency.
The parts live in capsules_restore / capsules_delta / capsules_disk; this module runs them
in order and assembles settings, results, targets and tables.
"""
from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ...session import Session
from . import BenchOptions, SuiteResult
from .capsules_delta import control_loop, measure_delta, summarize_delta
from .capsules_disk import filesystem_of, fsync_latency, sequential_bandwidth
from .capsules_restore import SOURCE_MODULES, measure_restore
from .timing import announcer

CONTEXTS, QUICK_CONTEXTS, TINY_CONTEXTS = (1024, 2048, 4096, 8192), (1024, 4096), (256, 1024)
REPS, QUICK_REPS = 3, 2
RUNTIME = {"kv_pool_mb": 96, "max_context": 9216}      # room for 8K tokens of builtin:small, fp32
DELTA_STEPS, QUICK_DELTA_STEPS, NEW_TOKENS = 40, 15, 8
DELTA_CONTEXT = 4096                                     # the delta run continues this context's capsule
LOOP_STEPS, QUICK_LOOP_STEPS, LOOP_PERIOD_S, LOOP_WARMUP = 300, 100, 0.01, 5
DISK_MB, QUICK_DISK_MB = 256, 64
TARGET_RATIO_4K, TARGET_WRITE_AMP, TARGET_STALL_P99_MS = 20.0, 1.2, 1.0
NOTES = (
    "restore and cold times are medians of fresh child processes, imports excluded, timed from just "
    "before Session.open to after the first generated token; both include loading the model",
    "the restore store was written moments before by the first cold run, so its bytes are read from the "
    "page cache (as after a crash; after a power cut they come from the disk: compare with direct_read_mb_s)",
    "restore_bytes: the epoch's record bytes (pages + manifest), i.e. what a restore reads; store_disk_bytes: "
    "the store folder on disk (segments + SQLite index), an upper bound",
    "full_state_bytes: live KV blocks x block page bytes + input regions + host blobs; a llama.cpp-style "
    "save writes it every time (llama.cpp keeps f16 KV, this run fp32)",
    "dirty_page_bytes: KV blocks the new positions landed in x page bytes + host/region pages that changed; "
    "a 16-token block page is rewritten whole when 8 tokens land in it",
    "the 100 Hz loop runs builtin:tiny whatever --model says; stall = time inside checkpoint(wait=False)",
    "a 1-min load average above usable_cores means other processes competed for the CPU during the run: "
    "torch's spinning threads then slow compute-heavy runs (the cold path most), so each context also "
    "reports the ratio of the best runs",
)


def _contexts(opts: BenchOptions) -> tuple[int, ...]:
    if opts.model == "builtin:tiny":  # tests: the tiny model's numbers mean little, keep them fast
        return TINY_CONTEXTS
    return QUICK_CONTEXTS if opts.quick else CONTEXTS


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _restore_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    at_4k = next((r for r in rows if r["target_tokens"] == 4096), None)
    return {"contexts": rows, "target_ratio_at_4096": TARGET_RATIO_4K,
            "ratio_at_4096": at_4k["ratio"] if at_4k else None,
            "ratio_of_min_at_4096": at_4k["ratio_of_min"] if at_4k else None,
            "target_met": at_4k["ratio"] >= TARGET_RATIO_4K if at_4k else None,
            "target_met_best_runs": at_4k["ratio_of_min"] >= TARGET_RATIO_4K if at_4k else None}


def _throughput(largest: dict[str, Any], disk: dict[str, Any]) -> dict[str, Any]:
    nbytes = largest["restore_bytes"]
    restore = nbytes / largest["restore_in_open_s"] / 1e6
    with_open = nbytes / largest["restore_open_s"] / 1e6
    direct = disk["direct_read_mb_s"]
    return {"context_tokens": largest["context_tokens"], "restore_bytes": nbytes,
            "restore_mb_s": restore, "restore_incl_model_load_mb_s": with_open,
            **disk, "restore_over_cached_read": restore / disk["cached_read_mb_s"],
            "restore_over_direct_read": restore / direct if direct else None}


def _stall(without: dict[str, Any], with_: dict[str, Any]) -> dict[str, Any]:
    return {"without": without, "with": with_, "added_stall_p50_ms": with_["stall_p50_ms"],
            "added_stall_p99_ms": with_["stall_p99_ms"],
            "added_work_p99_ms": with_["work_p99_ms"] - without["work_p99_ms"],
            "target_stall_p99_ms": TARGET_STALL_P99_MS,
            "target_met": with_["stall_p99_ms"] < TARGET_STALL_P99_MS}


def _targets(restore: dict[str, Any], delta: dict[str, Any], stall: dict[str, Any]) -> list[dict[str, Any]]:
    def met(flag: bool | None) -> str:
        return "n/a" if flag is None else ("yes" if flag else "NO")
    amp = delta["write_amplification_max"]
    return [{"target": "restore >= 20x cold at 4K (medians)", "measured": restore["ratio_at_4096"],
             "met": met(restore["target_met"])},
            {"target": "restore >= 20x cold at 4K (best runs)", "measured": restore["ratio_of_min_at_4096"],
             "met": met(restore["target_met_best_runs"])},
            {"target": "write amplification <= 1.2x dirty (max over epochs)", "measured": amp,
             "met": met(amp <= TARGET_WRITE_AMP)},
            {"target": "p99 added stall < 1 ms", "measured": stall["added_stall_p99_ms"],
             "met": met(stall["target_met"])}]


def _tables(restore: dict[str, Any], delta: dict[str, Any], stall: dict[str, Any], tput: dict[str, Any],
            fsync: dict[str, Any], targets: list[dict[str, Any]], load: dict[str, float]
            ) -> dict[str, list[dict[str, Any]]]:
    ms = 1e3
    main = [{"tokens": r["context_tokens"], "cold_ms": r["cold_s"] * ms, "restore_ms": r["restore_s"] * ms,
             "cold/restore": r["ratio"], "best_cold_ms": r["cold_min_s"] * ms,
             "best_restore_ms": r["restore_min_s"] * ms, "best_ratio": r["ratio_of_min"]}
            for r in restore["contexts"]]
    parts = [{"tokens": r["context_tokens"], "cold_open_ms": r["cold_open_s"] * ms,
              "cold_tokenize_ms": r["cold_tokenize_s"] * ms, "cold_prefill_ms": r["cold_prefill_first_token_s"] * ms,
              "restore_open_ms": r["restore_open_s"] * ms, "of_which_restore_ms": r["restore_in_open_s"] * ms,
              "restore_1st_token_ms": r["restore_first_token_s"] * ms, "restore_MB": r["restore_bytes"] / 1e6,
              "store_disk_MB": r["store_disk_bytes"] / 1e6} for r in restore["contexts"]]
    # a fresh process from spawn to its first restored token, and where that time goes
    process = [{"tokens": r["context_tokens"], "interpreter_ms": r["restore_interpreter_s"] * ms,
                "imports_ms": r["restore_import_s"] * ms, "open_restore_ms": r["restore_open_s"] * ms,
                "first_token_ms": r["restore_first_token_s"] * ms, "spawn_to_token_ms": r["restore_process_s"] * ms,
                "cold_spawn_to_token_ms": r["cold_process_s"] * ms} for r in restore["contexts"]]
    d = delta
    epoch = [{"epochs": d["epochs"], "written_KB_p50": d["bytes_written_p50"] / 1e3,
              "dirty_KB_p50": d["dirty_page_bytes_p50"] / 1e3, "full_state_KB_p50": d["full_state_bytes_p50"] / 1e3,
              "written/full": d["written_over_full_p50"], "write_amp_p50": d["write_amplification_p50"],
              "write_amp_max": d["write_amplification_max"], "written/new_tokens": d["written_over_new_tokens_p50"],
              "full_save/written": d["full_save_over_written_p50"]}]
    loop = [{"checkpoints": "on" if r["checkpoints"] else "off", "steps": r["steps"],
             "work_p50_ms": r["work_p50_ms"], "work_p99_ms": r["work_p99_ms"],
             "stall_p50_ms": r.get("stall_p50_ms"), "stall_p99_ms": r.get("stall_p99_ms"),
             "misses": r["deadline_misses"], "epochs": r.get("epochs_committed"),
             "epochs/sync": r.get("epochs_per_sync")} for r in (stall["without"], stall["with"])]
    disk = [{"read": "restore (in open)", "MB_s": tput["restore_mb_s"]},
            {"read": "restore incl. model load", "MB_s": tput["restore_incl_model_load_mb_s"]},
            {"read": "sequential, page cache", "MB_s": tput["cached_read_mb_s"]},
            {"read": "sequential, O_DIRECT", "MB_s": tput["direct_read_mb_s"]},
            {"read": "write + fsync", "MB_s": tput["write_fsync_mb_s"]}]
    for row in disk:  # how much of each disk figure the restore reaches
        is_disk = not row["read"].startswith("restore")
        row["restore_fraction"] = tput["restore_mb_s"] / row["MB_s"] if is_disk and row["MB_s"] else None
    return {"restore-to-first-token, fresh process (medians)": main,
            "restore vs cold breakdown (medians)": parts,
            "restore from process spawn (medians)": process,
            f"bytes per epoch, +{NEW_TOKENS} tokens a step": epoch,
            "checkpoint(wait=False) stall, 100 Hz loop, builtin:tiny": loop,
            f"read throughput at {tput['context_tokens']} tokens (MB/s)": disk,
            f"fsync: append {fsync['append_kb']} KB + fdatasync": [fsync],
            "1-min load average (other processes compete for the CPU)": [load],
            "targets": targets}


def run(opts: BenchOptions) -> SuiteResult:
    """Run the capsules suite on opts.model (builtin:small by default: seeded random, untrained)."""
    contexts = _contexts(opts)
    reps = QUICK_REPS if opts.quick else REPS
    delta_steps = opts.steps or (QUICK_DELTA_STEPS if opts.quick else DELTA_STEPS)
    loop_steps = opts.steps or (QUICK_LOOP_STEPS if opts.quick else LOOP_STEPS)
    disk_mb = QUICK_DISK_MB if opts.quick else DISK_MB
    start = max((c for c in contexts if c <= DELTA_CONTEXT), default=contexts[0])
    with tempfile.TemporaryDirectory(prefix="capsule-bench-") as tmp:
        work = Path(tmp)
        load = {"usable_cores": _usable_cores(), "start": os.getloadavg()[0]}
        with Session.open(work / "probe", model=opts.model, device=opts.device, runtime=RUNTIME,
                          restore=False) as s:  # tokenizer and layout; materializes a builtin once
            tokenizer, pool = s.tokenizer, s.registry["kv_pool"]
            settings = {"model": opts.model, "untrained": bool(getattr(s.model_info, "untrained", False)),
                        "profile": s.profile.name, "device": str(pool.tensor.device),
                        "dtype": s.profile.runtime.dtype, "runtime": RUNTIME,
                        "block_size": s.profile.runtime.block_size, "kv_page_bytes": pool.page_bytes,
                        "kv_bytes_per_token": pool.page_bytes // s.profile.runtime.block_size}
        settings.update({"contexts": list(contexts), "reps": reps, "quick": opts.quick,
                         "transcript": f"stdlib sources {', '.join(SOURCE_MODULES)} "
                                       f"(Python {platform.python_version()}), first N tokens",
                         "delta_start_context": start, "delta_steps": delta_steps, "new_tokens_per_step": NEW_TOKENS,
                         "loop_model": "builtin:tiny", "loop_steps": loop_steps, "loop_period_ms": LOOP_PERIOD_S * 1e3,
                         "loop_warmup_steps": LOOP_WARMUP, "disk_file_mb": disk_mb, "temp_dir": tmp,
                         "temp_filesystem": filesystem_of(work),
                         "torch_threads": torch.get_num_threads(), "notes": list(NOTES)})

        say = announcer("capsules", opts.progress)
        t0 = time.perf_counter()
        say(f"restore vs cold start at {', '.join(map(str, contexts))} tokens, {reps} reps, fresh processes")
        rows, stores = measure_restore(tokenizer, contexts, reps, work, opts.model, opts.device, RUNTIME,
                                       opts.progress)
        restore = _restore_summary(rows)
        say(f"restore: {rows[-1]['ratio']:.1f}x faster than cold at {rows[-1]['context_tokens']} tokens "
            f"({time.perf_counter() - t0:.1f} s)")
        load["after_restore_runs"] = os.getloadavg()[0]
        say(f"deltas: {delta_steps} epochs of +{NEW_TOKENS} tokens from {start}")
        with Session.open(stores[start], model=opts.model, device=opts.device, runtime=RUNTIME) as s:
            epochs = measure_delta(s, delta_steps, NEW_TOKENS, opts.progress)
        delta = {**summarize_delta(epochs), "start_context": start, "per_epoch": epochs}
        say(f"control loop: {loop_steps} steps at {1 / LOOP_PERIOD_S:.0f} Hz without, then with a capsule a step")
        stall = _stall(control_loop(work / "loop-off", opts.device, loop_steps, False, LOOP_PERIOD_S,
                                    LOOP_WARMUP, opts.progress),
                       control_loop(work / "loop-on", opts.device, loop_steps, True, LOOP_PERIOD_S,
                                    LOOP_WARMUP, opts.progress))
        say(f"disk: sequential bandwidth over {disk_mb} MB and fsync latency")
        tput = _throughput(rows[-1], sequential_bandwidth(work, disk_mb))
        fsync = fsync_latency(work)
        say(f"done in {time.perf_counter() - t0:.1f} s")
        load["end"] = os.getloadavg()[0]
    targets = _targets(restore, delta, stall)
    results = {"restore": restore, "delta": delta, "stall": stall, "throughput": tput, "fsync": fsync,
               "targets": targets, "load_avg_1min": load}
    return SuiteResult(settings=settings, results=results,
                       tables=_tables(restore, delta, stall, tput, fsync, targets, load))
