"""`capsule bench --suite control`: policy step latency per engine, and control loops with capsules.

1. Latency: builtin:mlp, builtin:mlp-chunk and builtin:gru through each registered policy
   engine (policy/registry.py) that loads here (PolicyRunner.step, p50/p99 after a warm-up),
   and through Session.act on the profile's default engine (mlp-chunk runs its policy on every
   4th act; the rest is the queue).
2. Loops: a 100 Hz and a 500 Hz ControlLoop (MonotonicClock, "skip" on a miss) calling
   s.act(obs) on the main thread, over a Session holding builtin:gru AND an LLM (builtin:tiny).
   A separate "chat" thread plays the robot's conversation: CHAT_HZ times per second (on its
   own fixed grid) one s.append of a short user line and one s.generate(CHAT_TOKENS) on stream
   "chat" (a reply takes several ticks). act takes only the Session's policy lock and the
   loop's capsules are deferred while the LLM is busy, so neither waits for a chat call; CPU
   and GIL sharing with it is part of what is measured, not hidden. Each rate runs
   with capsules off and every 10 steps, with the chat thread and (as a control) without it.
   Misses are attributed from the loop's raw timings (see _attribute): by the checkpoint's
   stall, by a late start, during a chat call, during the background writer's work (whose
   store calls are timed by a bench-only probe; writer_busy_pct is its share of the loop).
opts.steps (tests) sets the timed latency steps and the steps of every loop run.
"""
from __future__ import annotations

import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import devices

from ...control import ControlLoop, MonotonicClock
from ...policy import load_policy, registry
from ...session import Session
from . import BenchOptions, SuiteResult
from .timing import percentile

POLICIES = ("builtin:mlp", "builtin:mlp-chunk", "builtin:gru")
LAT_STEPS, LAT_WARMUP, QUICK_LAT_STEPS, QUICK_LAT_WARMUP = 2000, 200, 300, 50
LOOPS = {100: 1000, 500: 2500}              # hz -> steps (10 s and 5 s)
QUICK_LOOPS = {100: 200, 500: 500}
CHECKPOINT_EVERY = 10
LLM_MODEL, LOOP_POLICY, KV_POOL_MB = "builtin:tiny", "builtin:gru", 64
CHAT_HZ, CHAT_TOKENS = 2.0, 12   # ~24 generated tokens a second, in replies longer than a tick
LINES = ("user: where is the red cup?\n", "user: stop near the door.\n", "user: pick up bin 7.\n",
         "user: how far is the shelf?\n", "user: open the gripper.\n", "user: what do you see?\n")


def _say(opts: BenchOptions, msg: str) -> None:
    if opts.progress:
        print(f"control: {msg}", file=sys.stderr, flush=True)


def time_calls(fn: Any, obs: dict, steps: int, warmup: int) -> dict[str, float]:
    """p50 / p99 / max microseconds of fn(obs) over `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn(obs)
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn(obs)
        lat.append(time.perf_counter() - t0)
    return {"p50_us": percentile(lat, 50) * 1e6, "p99_us": percentile(lat, 99) * 1e6, "max_us": max(lat) * 1e6}


def _latency(opts: BenchOptions, dev: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    rows, obs = [], {"observation.state": np.random.default_rng(0).standard_normal(14).astype(np.float32)}
    for src in POLICIES:
        for eng in registry.engine_names():       # every registered engine, loaded or skipped
            row = {"policy": src, "engine": eng, "path": "PolicyRunner.step", "steps": steps}
            try:
                runner = load_policy(src, device=dev, engines=(eng,))
            except Exception as exc:  # noqa: BLE001 - the reason goes into the table
                reason = str(exc).split(f"{eng}: ", 1)[-1].splitlines()[0]
                rows.append({**row, "steps": 0, "status": f"skipped: {reason}",
                             "p50_us": None, "p99_us": None, "max_us": None})
                _say(opts, f"latency {src} {eng}: skipped ({reason})")
                continue
            rows.append({**row, "status": f"ok ({runner.engine_detail})", **time_calls(runner.step, obs, steps, warmup)})
            _say(opts, f"latency {src} {eng}: p50 {rows[-1]['p50_us']:.1f} us")
        with tempfile.TemporaryDirectory(prefix="capsule-bench-control-") as tmp:
            with Session.open(Path(tmp) / "s", model=None, policy=src, device=opts.device) as s:
                rows.append({"policy": src, "engine": s.policy_engine, "path": "Session.act", "steps": steps,
                             "status": "ok (profile default)", **time_calls(s.act, obs, steps, warmup)})
        _say(opts, f"latency {src} Session.act ({rows[-1]['engine']}): p50 {rows[-1]['p50_us']:.1f} us")
    return rows


class ChatThread(threading.Thread):
    """CHAT_HZ times a second: append a user line to "chat", generate CHAT_TOKENS tokens; records
    each Session call's (name, start, end) perf_counter interval (the lock is held within it)."""

    def __init__(self, s: Session, seed: int) -> None:
        super().__init__(name="capsule-bench-chat", daemon=True)
        self.s, self.rng, self.stop = s, random.Random(seed), threading.Event()
        self.calls: list[tuple[str, float, float]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        t0, k = time.perf_counter(), 0
        try:
            while not self.stop.wait(max(0.0, t0 + k / CHAT_HZ - time.perf_counter())):
                a = time.perf_counter()
                self.s.append(self.rng.choice(LINES), stream="chat")
                b = time.perf_counter()
                self.s.generate(CHAT_TOKENS, stream="chat")
                self.calls += [("append", a, b), ("generate", b, time.perf_counter())]
                k = max(k + 1, math.ceil((time.perf_counter() - t0) * CHAT_HZ))   # late: skip, keep grid
        except BaseException as exc:  # noqa: BLE001 - re-raised on the loop thread
            self.error = exc


WRITER_CALLS = ("stage_epoch", "sync", "retain", "compact")   # what the Session's writer thread runs


def _probe_writer(store: Any, spans: list[tuple[str, float, float]]) -> None:
    """Bench-only look inside: record the (start, end) of every store call the background writer
    makes (write pages, fsync + commit, retention, compaction) by wrapping them on the instance."""
    for name in WRITER_CALLS:
        def timed(*args: Any, _inner: Any = getattr(store, name), _name: str = name, **kw: Any) -> Any:
            a = time.perf_counter()
            try:
                return _inner(*args, **kw)
            finally:
                spans.append((_name, a, time.perf_counter()))
        setattr(store, name, timed)


def _attribute(loop: ControlLoop, t0: float, spans: dict[str, list[tuple[str, float, float]]]) -> dict[str, int]:
    """Why each miss missed, from the loop's raw timings (offsets from t0); a miss may have several causes:
    by_checkpoint: the step alone ended in time, its checkpoint's stall pushed it past the deadline;
    late_start: step (+ checkpoint) would have fit had it started on time (sleep overshoot, CPU, GIL);
    during_<name>: a call of that thread (chat: Session lock + GIL; writer: GIL + CPU) ran between the
    step's scheduled start and its end."""
    t, every, period = loop.timings(), loop.checkpoint_every, loop.period_s
    stalls = t["checkpoint_stall_s"]
    rel = {name: [(a - t0, b - t0) for _, a, b in calls] for name, calls in spans.items()}
    out = {"misses_by_checkpoint": 0, "misses_late_start": 0, **{f"misses_during_{n}": 0 for n in rel}}
    for i, (start, sched, dur) in enumerate(zip(t["start_s"], t["scheduled_s"], t["step_s"])):
        k = (i + 1) // every - 1 if every and (i + 1) % every == 0 else -1
        busy = dur + (stalls[k] if 0 <= k < len(stalls) else 0.0)
        if start + busy <= sched + period:
            continue
        out["misses_by_checkpoint"] += start + dur <= sched + period
        out["misses_late_start"] += busy <= period
        for n, sp in rel.items():
            out[f"misses_during_{n}"] += any(a < start + busy and b > sched for a, b in sp)
    return out


def _loop_run(opts: BenchOptions, hz: int, steps: int, every: int, chat: bool) -> dict[str, Any]:
    state = np.random.default_rng(1).standard_normal(14).astype(np.float32)
    obs = {"observation.state": state}
    with tempfile.TemporaryDirectory(prefix="capsule-bench-control-") as tmp:
        s = Session.open(Path(tmp) / "s", model=LLM_MODEL, policy=LOOP_POLICY, device=opts.device,
                         runtime={"kv_pool_mb": KV_POOL_MB})
        try:
            s.append("system: you are a robot arm's assistant.\n", stream="chat")
            s.generate(CHAT_TOKENS, stream="chat")          # warm-up, untimed
            for _ in range(50):
                s.act(obs)
            first: list[float] = []
            writer: list[tuple[str, float, float]] = []
            _probe_writer(s.store, writer)

            def step(tick: int) -> None:
                if not first:
                    first.append(time.perf_counter())
                state[0] = tick * 1e-3                       # a changing observation
                s.act(obs)

            loop = ControlLoop(s, hz, checkpoint_every=every, clock=MonotonicClock())
            talker = ChatThread(s, seed=hz + every)
            if chat:
                talker.start()
            try:
                st = loop.run(step, steps)
            finally:
                talker.stop.set()
                if chat:
                    talker.join()
            if talker.error is not None:
                raise talker.error
            calls, in_loop, engine, f0 = talker.calls, list(writer), s.policy_engine, time.perf_counter()
            s.flush()                                        # outside the timed loop
            flush_ms = (time.perf_counter() - f0) * 1e3
        finally:
            s.close()
    t = loop.timings()
    t0, wall = first[0] - t["start_s"][0], t["start_s"][-1] + t["step_s"][-1]
    why = _attribute(loop, t0, {"chat": calls, "writer": in_loop})
    gen = [(b - a) * 1e3 for n, a, b in calls if n == "generate"]
    busy = sum(max(0.0, min(b, t0 + wall) - max(a, t0)) for _, a, b in in_loop)
    return {"hz": hz, "chat": "on" if chat else "off", "capsules": f"every {every}" if every else "off",
            "steps": st.steps, "misses": st.misses, "misses_with_checkpoint": st.misses_with_checkpoint,
            **why, "missed_ticks": st.missed_ticks,
            "step_p50_ms": st.step_p50_ms, "step_p99_ms": st.step_p99_ms, "step_max_ms": st.step_max_ms,
            "jitter_p99_ms": st.jitter_p99_ms, "checkpoints": st.checkpoints,
            "ckpt_stall_p50_ms": st.checkpoint_stall_p50_ms, "ckpt_stall_p99_ms": st.checkpoint_stall_p99_ms,
            "ckpt_stall_max_ms": st.checkpoint_stall_max_ms, "writer_busy_pct": 100 * busy / wall if wall else 0.0,
            "chat_turns": len(gen), "chat_generate_p50_ms": percentile(gen, 50) if gen else None,
            "chat_generate_max_ms": max(gen) if gen else None, "flush_ms": flush_ms, "engine": engine}


def _targets(loops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for chat, label in (("on", "with the chat thread"), ("off", "control: no chat thread")):
        by = {r["capsules"]: r for r in loops if r["hz"] == 100 and r["chat"] == chat}
        on, off = by.get(f"every {CHECKPOINT_EVERY}"), by.get("off")
        if on is None or off is None:
            continue
        met = on["misses_with_checkpoint"] == 0 and on["misses"] - off["misses"] <= 0
        out.append({"target": f"zero misses caused by capsules at 100 Hz ({label})",
                    "measured": f"misses_with_checkpoint={on['misses_with_checkpoint']} "
                                f"(of which the stall alone: {on['misses_by_checkpoint']}); "
                                f"misses capsules on={on['misses']}, off={off['misses']}",
                    "met": "yes" if met else "NO"})
    return out


def _loadavg() -> str | None:
    p = Path("/proc/loadavg")
    return p.read_text().strip() if p.exists() else None


def run(opts: BenchOptions) -> SuiteResult:
    """Run the control suite (see the module docstring); opts.model is not used (LLM: builtin:tiny)."""
    profile = devices.detect_profile(opts.device)
    dev = "cuda" if profile.device == "cuda" else "cpu"
    lat_steps = opts.steps or (QUICK_LAT_STEPS if opts.quick else LAT_STEPS)
    warmup = max(1, lat_steps // 10) if opts.steps else (QUICK_LAT_WARMUP if opts.quick else LAT_WARMUP)
    loops = {hz: opts.steps or n for hz, n in (QUICK_LOOPS if opts.quick else LOOPS).items()}
    load_before = _loadavg()
    latency = _latency(opts, dev, lat_steps, warmup)
    rows = []
    for hz, n in loops.items():
        for chat in (True, False):
            for every in (0, CHECKPOINT_EVERY):
                rows.append(r := _loop_run(opts, hz, n, every, chat))
                _say(opts, f"loop {hz} Hz chat {r['chat']} capsules {r['capsules']}: {r['misses']} misses "
                           f"({r['misses_with_checkpoint']} with a checkpoint), step p99 {r['step_p99_ms']:.2f} ms")
    targets = _targets(rows)
    settings = {
        "device": dev, "profile": profile.name, "engine_preference": list(profile.engines), "quick": opts.quick,
        "latency_steps": lat_steps, "latency_warmup": warmup,
        "latency_engines_tried": list(registry.engine_names()),
        "loop_steps": {str(hz): n for hz, n in loops.items()}, "loop_policy": LOOP_POLICY,
        "loop_llm": f"{LLM_MODEL} (untrained), kv_pool_mb {KV_POOL_MB}; --model is not used by this suite",
        "checkpoint_every": CHECKPOINT_EVERY, "on_miss": "skip", "spin_s": MonotonicClock().spin_s,
        "store": "a fresh temporary folder per loop run; flush and close after the timed loop",
        "threads": "main thread: control loop, s.act and checkpoint staging; the Session's background "
                   "writer: disk I/O and fsync; 'chat' thread (chat on): the same Session's LLM",
        "chat_thread": f"{CHAT_HZ:g} turns/s on its own grid: s.append(<short user line>, stream='chat') then "
                       f"s.generate({CHAT_TOKENS}, stream='chat'); each call holds the Session's LLM "
                       "lock: an act (policy lock only) does not wait for it; the loop's "
                       "checkpoint(wait=False, defer=True) does not either: when the LLM is busy the "
                       "capsule is taken as the chat call ends",
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        **{m: getattr(sys.modules.get(m), "__version__", None) for m in ("onnxruntime", "tensorrt")},
        "gil_switch_interval_ms": sys.getswitchinterval() * 1e3,
        "loadavg_before": load_before, "loadavg_after": _loadavg()}
    lat_cols = ("policy", "engine", "path", "status", "steps", "p50_us", "p99_us")
    loop_cols = ("hz", "chat", "capsules", "steps", "misses", "misses_with_checkpoint", "misses_by_checkpoint",
                 "misses_late_start", "misses_during_chat", "misses_during_writer", "missed_ticks", "step_p50_ms",
                 "step_p99_ms", "jitter_p99_ms", "ckpt_stall_p50_ms", "ckpt_stall_p99_ms", "ckpt_stall_max_ms",
                 "writer_busy_pct", "chat_turns", "chat_generate_p50_ms", "engine")
    tables = {"policy step latency": [{k: r[k] for k in lat_cols} for r in latency],
              "control loops": [{k: r[k] for k in loop_cols} for r in rows], "targets": targets}
    return SuiteResult(settings, {"latency": latency, "loops": rows, "targets": targets}, tables)
