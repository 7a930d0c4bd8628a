"""`capsule bench --suite fleet`: replication of committed capsules to S3 (a real server on loopback).

1. throughput: a replicated Session on the bench model grows a transcript epoch by epoch; MB/s and
   epochs/s of the background replicator, of a one-off `push`, and bytes sent vs written per epoch;
2. the step time a 100 Hz control loop sees with replication on vs off (alternating blocks);
3. an outage: the S3 server SIGKILLed while the robot keeps committing, then restarted: catch-up
   time, epochs skipped, and the checkpoint latency before / during / after;
4. a second machine: pull + open + first token in a fresh process vs a cold start, and whether
   the pulled copy continues with the source's very tokens.
The server is SeaweedFS's `weed mini` (capsule.tools.s3_server) in the run's temporary folder; the
AWS variables point boto3 at it for this run only. The parts live in fleet_throughput /
fleet_loop / fleet_outage / fleet_pull; this module runs them in order and makes the tables.
"""
from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ...fleet import Replication
from ...session import Session
from ..s3_server import LoopbackS3
from . import BenchOptions, SuiteResult
from .capsules import RUNTIME, _usable_cores
from .capsules_restore import transcripts
from .fleet_loop import loop_with_and_without
from .fleet_outage import NEW_TOKENS as OUTAGE_TOKENS, outage
from .fleet_pull import second_machine
from .fleet_throughput import NEW_TOKENS, grow, one_off_push
from .timing import announcer, progress

BUCKET = "fleet"
SIGN_KEY = b"capsule-bench-fleet-key-0123456789"   # signed replicas, as a fleet runs them (HMAC per epoch)
GROW_CONTEXT = 1024                  # the throughput session's transcript: its first, whole epoch
EPOCHS, QUICK_EPOCHS = 40, 10        # delta epochs after it (opts.steps overrides)
LOOP_TICKS, QUICK_LOOP_TICKS = 3000, 300     # per mode (opts.steps overrides)
LOOP_BLOCKS, QUICK_LOOP_BLOCKS = 6, 2
OUTAGE_S, QUICK_OUTAGE_S = 30.0, 5.0
PRE_S, QUICK_PRE_S, POST_S = 3.0, 1.5, 1.0
COMMIT_PERIOD_S = 0.25               # the robot's conversation commits 4 epochs a second through the outage
MAX_QUEUE, QUICK_MAX_QUEUE = 64, 8   # the default; quick: small enough that its 5 s outage overflows it
KEEP_EPOCHS = 1024                   # retention above the queue, so max_queue (not retention) bounds the backlog
CATCH_UP_TIMEOUT_S = 120.0
PULL_CONTEXT, QUICK_PULL_CONTEXT = 4096, 1024
REPS, QUICK_REPS = 3, 2
NOTES = (
    "one S3 server (SeaweedFS weed mini) on 127.0.0.1 shares the 2 cores with the robot: its CPU time is "
    "part of every figure; a real network adds latency and bandwidth limits that loopback has not",
    "sent bytes are what the remote holds per epoch (pack objects + the epoch object, listed by size), as the "
    "replicator's status.sent_bytes counts them",
    "background MB/s = bytes sent / (first checkpoint call -> remote caught up): when the replicator keeps up, "
    "that is the rate the session produced epochs (production_s), and lag_s is how far behind it ended",
    "push: the same store, closed, to a fresh prefix (every retained epoch, the oldest whole): upload alone",
    "100 Hz loop: the control suite's (builtin:gru + builtin:tiny, a capsule every 10 ticks, no chat thread); "
    "busy = step + the capsule it took; blocks alternate off/on (ABBA), a fresh Session each",
    "outage: the replicator retries with its default backoff (retry_s 0.5 s doubling to retry_max_s 5 s): the "
    "first retry after the server is back comes within retry_max_s (reconnect_s)",
    "retention: keep_epochs is raised to 1024 so that max_queue bounds the backlog; with the profile default "
    "(x86-cpu: 8), retention drops older waiting epochs first (status.skipped counts both)",
    "pull vs cold: fresh child processes, medians; imports (boto3 included) and the interpreter's start are "
    "excluded and reported apart; both include loading the model",
)


@contextlib.contextmanager
def loopback_s3(folder: Path) -> Iterator[tuple[LoopbackS3, float]]:
    """A started server with the AWS variables pointing at it and the bucket made; on exit (Ctrl-C
    included) the server stops and os.environ is as it was."""
    server = LoopbackS3(folder)
    env = server.env()
    saved = {k: os.environ.get(k) for k in env}
    try:
        boot = server.start()
        server.make_bucket(BUCKET)
        os.environ.update(env)
        yield server, boot
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _tables(r: dict[str, Any], load: dict[str, float]) -> dict[str, list[dict[str, Any]]]:
    g, p, lp, o, m = r["throughput"], r["push"], r["loop"], r["outage"], r["second_machine"]
    tput = [{"path": "background replicator", "epochs": g["epochs"], "MB_sent": g["sent_bytes"] / 1e6,
             "seconds": g["seconds"], "MB_s": g["mb_s"], "epochs_s": g["epochs_s"],
             "production_s": g["production_s"], "lag_s": g["lag_s"], "caught_up": g["caught_up"]},
            {"path": "one-off push (fresh prefix)", "epochs": p["epochs"], "MB_sent": p["sent_bytes"] / 1e6,
             "seconds": p["seconds"], "MB_s": p["mb_s"], "epochs_s": p["epochs_s"], "production_s": None,
             "lag_s": None, "caught_up": True}]
    per_epoch = [{"epoch": "first (whole)", "written_KB": g["first_written_bytes"] / 1e3,
                  "sent_KB": g["first_sent_bytes"] / 1e3,
                  "sent/written": g["first_sent_bytes"] / g["first_written_bytes"],
                  "of_which_epoch_object_KB": g["first_object_bytes"] / 1e3},
                 {"epoch": f"delta (+{NEW_TOKENS} tokens), p50", "written_KB": g["delta_written_p50"] / 1e3,
                  "sent_KB": g["delta_sent_p50"] / 1e3, "sent/written": g["delta_sent_over_written_p50"],
                  "of_which_epoch_object_KB": g["delta_object_p50"] / 1e3}]
    loop = [{"replicate": s["replicate"], "steps": s["steps"], "step_p50_ms": s["step_p50_ms"],
             "step_p99_ms": s["step_p99_ms"], "worst_block_p99_ms": max(s["block_step_p99_ms"]),
             "busy_p99_ms": s["busy_p99_ms"], "ckpt_stall_p99_ms": s["ckpt_stall_p99_ms"],
             "jitter_p99_ms": s["jitter_p99_ms"], "misses": s["misses"], "missed_ticks": s["missed_ticks"],
             "p99_vs_off": s["step_p99_ms"] / lp["without"]["step_p99_ms"],
             "busy_p99_vs_off": s["busy_p99_ms"] / lp["without"]["busy_p99_ms"],
             "epochs_uploaded": s.get("uploaded"),
             "remote_B_per_epoch": s["remote_bytes"] / s["uploaded"] if s.get("uploaded") else None}
            for s in (lp["without"], lp["with"])]
    catch = [{"outage_s": o["outage_s"], "committed_during": o["epochs_committed_during_outage"],
              "committed_while_down": o["epochs_committed_while_down"],
              "max_queue": o["max_queue"], "skipped": o["skipped"], "not_on_remote": o["not_on_remote"],
              "server_boot_s": o["server_boot_s"], "reconnect_s": o["reconnect_s"], "catch_up_s": o["catch_up_s"],
              "live_s": o["live_s"], "caught_up": o["caught_up"]}]
    lat = [{"phase": ph, **o[f"checkpoint_{ph}"]} for ph in ("before", "during", "after")]
    ms = 1e3
    pull = [{"path": "pull + open + 1st token", "total_ms": m["pull_path_s"] * ms, "pull_ms": m["pull_s"] * ms,
             "open_ms": m["pull_open_restore_s"] * ms, "append_ms": None,
             "first_token_ms": m["pull_first_token_s"] * ms},
            {"path": "cold: open + append + 1st token", "total_ms": m["cold_s"] * ms, "pull_ms": None,
             "open_ms": m["cold_open_s"] * ms, "append_ms": m["cold_append_s"] * ms,
             "first_token_ms": m["cold_prefill_first_token_s"] * ms}]
    pull_sum = [{"tokens": m["context_tokens"], "cold/pull": m["cold_over_pull"],
                 "continuation_equal": m["continuation_equal"], "pulled_MB": m["pulled_bytes"] / 1e6,
                 "pull_MB_s": m["pull_mb_s"], "interpreter_start_ms": m["interpreter_start_s"] * ms,
                 "imports_ms": m["imports_s"] * ms}]
    return {"replication throughput": tput, "bytes per epoch: store vs remote": per_epoch,
            f"100 Hz loop, replication off vs on ({lp['with']['steps']} ticks each)": loop,
            "catch-up after an S3 outage": catch,
            "checkpoint(wait=True) latency around the outage (ms)": lat,
            "second machine: pull vs cold start, fresh processes (medians)": pull,
            "second machine: summary": pull_sum,
            "1-min load average (other processes compete for the CPU)": [load]}


def run(opts: BenchOptions) -> SuiteResult:
    """Run the fleet suite on opts.model (builtin:small by default); see the module docstring."""
    q = opts.quick
    epochs = opts.steps or (QUICK_EPOCHS if q else EPOCHS)
    ticks = opts.steps or (QUICK_LOOP_TICKS if q else LOOP_TICKS)
    blocks = QUICK_LOOP_BLOCKS if q else LOOP_BLOCKS
    outage_s, pre_s = (QUICK_OUTAGE_S, QUICK_PRE_S) if q else (OUTAGE_S, PRE_S)
    max_queue = QUICK_MAX_QUEUE if q else MAX_QUEUE
    pull_context, reps = (QUICK_PULL_CONTEXT, QUICK_REPS) if q else (PULL_CONTEXT, REPS)
    say = announcer("fleet", opts.progress)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="capsule-bench-fleet-"))
        srv, boot = stack.enter_context(loopback_s3(Path(tmp) / "weed"))
        work, url = Path(tmp), f"s3://{BUCKET}/bench"
        load = {"usable_cores": _usable_cores(), "start": os.getloadavg()[0]}
        t0 = time.perf_counter()
        say(f"S3 server (weed mini) up in {boot:.2f} s at {srv.endpoint}")
        # the default queue while measuring throughput; the outage reopens the store with max_queue (the
        # robot restarted: it restores its capsule and the replicator resumes where the remote stands)
        open_robot = functools.partial(Session.open, work / "robot", model=opts.model, device=opts.device,
                                       runtime=RUNTIME, keep_epochs=KEEP_EPOCHS)
        with open_robot(replicate=Replication(f"{url}/robot", sign_key=SIGN_KEY)) as s:
            say(f"throughput: {GROW_CONTEXT} tokens, then {epochs} epochs of +{NEW_TOKENS} tokens, replicated")
            text = transcripts(s.tokenizer, [GROW_CONTEXT])[GROW_CONTEXT]
            results["throughput"] = g = grow(s, text, epochs, opts.progress)
            say(f"throughput: {g['mb_s']:.2f} MB/s, {g['epochs_s']:.1f} epochs/s (lag {g['lag_s'] * 1e3:.0f} ms); "
                f"a delta sends {g['delta_sent_p50'] / 1e3:.0f} KB for {g['delta_written_p50'] / 1e3:.0f} KB written")
            load["after_throughput"] = os.getloadavg()[0]
        robot = Replication(f"{url}/robot", sign_key=SIGN_KEY, max_queue=max_queue,
                            close_timeout_s=5)     # caught up by then, unless interrupted mid-outage
        with open_robot(replicate=robot) as s:
            say(f"outage: S3 killed for {outage_s:g} s while committing every {COMMIT_PERIOD_S} s "
                f"(max_queue {max_queue})")
            results["outage"] = o = outage(s, robot, srv, pre_s=pre_s, outage_s=outage_s, post_s=POST_S,
                                           period_s=COMMIT_PERIOD_S, timeout_s=CATCH_UP_TIMEOUT_S)
            say(f"outage: caught up {_num(o['catch_up_s'])} s after the server was back (reconnect "
                f"{_num(o['reconnect_s'])} s), {o['skipped']} skipped; checkpoint p99 before "
                f"{_num(o['checkpoint_before']['p99_ms'])} ms, during {_num(o['checkpoint_during']['p99_ms'])} ms")
            load["after_outage"] = os.getloadavg()[0]
        say("push: the same store to a fresh prefix, one-off")
        results["push"] = p = one_off_push(work / "robot", f"{url}/pushed", SIGN_KEY)
        say(f"push: {p['epochs']} epochs, {p['mb_s']:.2f} MB/s, {p['epochs_s']:.1f} epochs/s")
        say(f"loop: 100 Hz, {ticks} ticks without and {ticks} with replication, {blocks} alternating blocks")
        bar = progress(2 * ticks, "100 Hz loop blocks, replication off/on", opts.progress, unit="tick")
        results["loop"] = lp = loop_with_and_without(work / "loops", opts.device, ticks, blocks, f"{url}/loop",
                                                     SIGN_KEY, bar)
        bar.close()
        say(f"loop: step p99 {lp['without']['step_p99_ms']:.3f} ms off, {lp['with']['step_p99_ms']:.3f} ms on "
            f"(x{lp['step_p99_ratio']:.2f}); misses {lp['without']['misses']} off, {lp['with']['misses']} on")
        load["after_loop"] = os.getloadavg()[0]
        say(f"second machine: {pull_context} tokens replicated, then pull vs cold start, {reps} reps each")
        results["second_machine"] = m = second_machine(work / "second", f"{url}/source", SIGN_KEY, opts.model,
                                                       opts.device, RUNTIME, pull_context, reps, opts.progress)
        say(f"second machine: pull path {m['pull_path_s'] * 1e3:.0f} ms vs cold {m['cold_s'] * 1e3:.0f} ms "
            f"(x{m['cold_over_pull']:.1f}), continuation equal: {m['continuation_equal']}")
        load["end"] = os.getloadavg()[0]
        say(f"done in {time.perf_counter() - t0:.1f} s")
        settings = {"model": opts.model, "device": opts.device, "quick": q, "runtime": RUNTIME,
                    "server": "SeaweedFS weed mini on 127.0.0.1 (capsule.tools.s3_server.LoopbackS3)",
                    "server_boot_s": boot, "signed": True, "grow_context": GROW_CONTEXT, "delta_epochs": epochs,
                    "new_tokens_per_epoch": NEW_TOKENS, "keep_epochs": KEEP_EPOCHS,
                    "max_queue": f"{max_queue} in the outage (throughput: the default)",
                    "loop_ticks_per_mode": ticks, "loop_blocks": blocks, "outage_s": outage_s,
                    "outage_commit_period_s": COMMIT_PERIOD_S, "outage_new_tokens": OUTAGE_TOKENS,
                    "pull_context": pull_context, "reps": reps, "temp_dir": tmp, "notes": list(NOTES)}
    results["load_avg_1min"] = load
    return SuiteResult(settings=settings, results=results, tables=_tables(results, load))
