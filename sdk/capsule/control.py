"""ControlLoop: drive a robot's step function at a fixed rate, with deadline scheduling and capsules.

Threading contract: call ``run`` on one thread (the control thread); a second concurrent ``run``
raises RuntimeError. ``stop()``, ``stats()`` and ``timings()`` may be called from any thread;
``stop()`` ends the loop after the step in progress (a stop() made while no run is active makes
the next run return before its first step).

Schedule: tick k is due at ``t0 + k * period`` (computed from t0, never accumulated, so sleep
error does not drift the grid). ``step(tick)`` receives that schedule index, so ``tick * period``
is the step's nominal time even after ticks were skipped.

Miss: a step whose end (after its checkpoint, when it takes one) is later than its deadline,
``scheduled start + period``. Recovery after a miss (``on_miss``):
  * "skip" (default): re-align to the first period boundary at or after the end; the ticks
    passed over are counted in ``missed_ticks`` (only those that would have run: none after the
    last step of a ``steps`` run or a stop(), none past ``duration_s``) and never run. The grid
    is kept.
  * "catch_up": run the late ticks back to back, as soon as possible, until the schedule is
    met again. No tick is lost, but late ticks show up as misses and as jitter, and a loop that
    is overloaded for good falls further behind without bound.

Capsules: after every ``checkpoint_every`` steps the loop calls ``session.checkpoint(wait=False)``
(with ``defer=True`` for a Session, so it never waits for an LLM call on another thread: that
call takes the capsule as it ends) on the control thread. That only stages host copies of the
dirty pages (disk I/O and fsync run on the Session's writer thread); its stall is measured apart
from the step's own time.

Checkpoint failures (``on_checkpoint_error``): a background write failure (disk full, a
StoreError / StoreIOError) is raised by the session's *next* checkpoint call, so it reaches the
loop one capsule late. "raise" (default): the exception ends run() (stats() / timings() cover
the steps before it). "continue": the loop keeps stepping past any Exception from checkpoint;
it is counted in ``checkpoint_failures`` (with ``last_checkpoint_error``), the first one of a
run is reported with one RuntimeWarning, and the next scheduled capsule is tried as usual. With a Session, the
call that reports a failure takes no capsule itself, and the next one is a full capsule
(standing on its own), so it may stall longer than a delta. ``checkpoints`` counts calls made,
failed ones included. A write that fails after the run's last capsule is raised by the
session's next checkpoint / flush / close, not by run().
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from .stats import percentile

ON_MISS = ("skip", "catch_up")
ON_CHECKPOINT_ERROR = ("raise", "continue")
MAX_HZ = 10_000.0
_COLS = 4   # per-step record: start offset, scheduled offset, step duration, |start - scheduled|


class Checkpointing(Protocol):
    """What a ControlLoop needs of a session when checkpoint_every > 0 (a capsule.Session; its
    defer=True is used when the signature has it)."""
    def checkpoint(self, *, wait: bool = True, name: str | None = None) -> int | None: ...


class Clock(Protocol):
    def now(self) -> float: ...                  # monotonic seconds
    def sleep_until(self, t: float) -> None: ...  # return at (or just after) now() == t


class MonotonicClock:
    """time.perf_counter with a precise sleep: time.sleep for the coarse part, then a busy spin.

    CPU cost: the spin burns up to ``spin_s`` of one core per tick (the default 0.5 ms is 5% of
    a core at 100 Hz, 50% at 1 kHz). spin_s=0 spends nothing but inherits the OS sleep overshoot
    (typically 50-100 us on Linux, more under load or on power-saving kernels).
    """

    def __init__(self, spin_s: float = 0.0005) -> None:
        if isinstance(spin_s, bool) or not isinstance(spin_s, (int, float)) or not 0 <= spin_s < 1:
            raise ValueError(f"spin_s must be a number of seconds in [0, 1), got {spin_s!r}")
        self.spin_s = float(spin_s)

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, t: float) -> None:
        coarse = t - time.perf_counter() - self.spin_s
        if coarse > 0:
            time.sleep(coarse)
        while time.perf_counter() < t:
            pass


class FakeClock:
    """A clock that only moves when told: sleep_until jumps to t (never backwards); advance(dt)."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def sleep_until(self, t: float) -> None:
        if t > self._t:
            self._t = t

    def advance(self, dt: float) -> None:
        if not dt >= 0:
            raise ValueError(f"a clock cannot go backwards: dt must be >= 0, got {dt!r}")
        self._t += dt


@dataclass(frozen=True)
class LoopStats:
    steps: int
    hz: float
    period_s: float
    step_p50_ms: float
    step_p99_ms: float
    step_max_ms: float
    misses: int
    missed_ticks: int               # ticks skipped to recover ("skip" mode only)
    jitter_p99_ms: float            # |actual start - scheduled start|
    checkpoints: int
    checkpoint_stall_p50_ms: float
    checkpoint_stall_p99_ms: float
    checkpoint_stall_max_ms: float
    misses_with_checkpoint: int     # misses on steps that took a checkpoint
    checkpoint_failures: int = 0    # checkpoint calls that raised ("continue" mode; counted in checkpoints)
    last_checkpoint_error: str | None = None   # "ExcType: message" of the latest such failure


def _ms(values: np.ndarray, q: float) -> float:
    return percentile(values.tolist(), q) * 1e3 if len(values) else 0.0


class ControlLoop:
    """Calls step(tick) at hz on a deadline schedule; see the module docstring for the contract."""

    def __init__(self, session: Checkpointing | None, hz: float = 100.0, *, checkpoint_every: int = 0,
                 clock: Clock | None = None, on_miss: str = "skip",
                 on_checkpoint_error: str = "raise") -> None:
        if isinstance(hz, bool) or not isinstance(hz, (int, float)) or not 0 < hz <= MAX_HZ:
            raise ValueError(f"hz must be a number > 0 and <= {MAX_HZ:g}, got {hz!r}")
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an int >= 0 (0 = no capsules), got {checkpoint_every!r}")
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {', '.join(map(repr, ON_MISS))}, got {on_miss!r}")
        if not isinstance(on_checkpoint_error, str) or on_checkpoint_error not in ON_CHECKPOINT_ERROR:
            raise ValueError(f"on_checkpoint_error must be one of {', '.join(map(repr, ON_CHECKPOINT_ERROR))}, "
                             f"got {on_checkpoint_error!r}")
        if checkpoint_every and not callable(getattr(session, "checkpoint", None)):
            raise ValueError(f"checkpoint_every={checkpoint_every} needs a session with checkpoint(wait=False) "
                             f"(a capsule.Session), got {type(session).__name__}")
        self.session = session
        # a Session's defer=True: never wait for an LLM call on another thread (the capsule is
        # taken as that call ends); other sessions get plain wait=False
        self._ckpt_args = {"wait": False}
        if checkpoint_every and "defer" in inspect.signature(session.checkpoint).parameters:
            self._ckpt_args["defer"] = True
        self.hz = float(hz)
        self.period_s = 1.0 / self.hz
        self.checkpoint_every = checkpoint_every
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.on_miss = on_miss
        self.on_checkpoint_error = on_checkpoint_error
        self._stop = threading.Event()
        self._running = threading.Lock()
        self._reset(0)

    def _reset(self, capacity: int) -> None:
        self._rec = np.zeros((capacity, _COLS))
        self._stalls = np.zeros(capacity // self.checkpoint_every + 1 if self.checkpoint_every else 0)
        self._n = self._n_ckpt = 0
        self._misses = self._missed_ticks = self._misses_ckpt = 0
        self._ckpt_failures = 0
        self._ckpt_error: str | None = None

    def stop(self) -> None:
        """End the running loop after its current step (safe from any thread)."""
        self._stop.set()

    def run(self, step: Callable[[int], Any], steps: int | None = None, *,
            duration_s: float | None = None) -> LoopStats:
        """Run until `steps` steps were made, the schedule passed `duration_s`, or stop().

        With neither limit it runs until stop(). An exception from step propagates, and so does
        one from a checkpoint unless on_checkpoint_error="continue" (then it is counted in
        stats().checkpoint_failures and warned about once per run); stats() / timings() then
        cover the steps completed before it.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an int >= 1 or None, got {steps!r}")
        if duration_s is not None and (isinstance(duration_s, bool) or not isinstance(duration_s, (int, float))
                                       or not 0 < duration_s < math.inf):
            raise ValueError(f"duration_s must be a finite number of seconds > 0 or None, got {duration_s!r}")
        if not self._running.acquire(blocking=False):
            raise RuntimeError("run() is already active on another thread; one ControlLoop runs once at a time")
        try:
            if steps is not None:
                cap = steps
            elif duration_s is not None:
                cap = math.ceil(duration_s * self.hz) + 1
            else:
                cap = 1024
            self._reset(min(cap, 1 << 20))   # beyond ~1M steps grow by doubling instead
            # a tick count, not a float comparison per tick: 0.3 s at 100 Hz is 30 ticks, not 31
            end_tick = sys.maxsize if duration_s is None else math.ceil(duration_s * self.hz - 1e-9)
            self._loop(step, steps if steps is not None else -1, end_tick)
        finally:
            self._stop.clear()
            self._running.release()
        return self.stats()

    def _loop(self, step: Callable[[int], Any], limit: int, end_tick: int) -> None:
        # hot path: locals only; per step a few float ops and scalar writes into preallocated arrays
        clock, period, every = self.clock, self.period_s, self.checkpoint_every
        skip, stop, session = self.on_miss == "skip", self._stop, self.session
        keep_going = self.on_checkpoint_error == "continue"
        t0 = clock.now()
        tick = n = expected = 0
        while n != limit and not stop.is_set():
            # ticks passed over count once another step follows (or the duration ends), not after the last
            self._missed_ticks += min(tick, end_tick) - expected
            if tick >= end_tick:
                break
            expected = tick + 1
            sched_off = tick * period
            sched = t0 + sched_off
            clock.sleep_until(sched)
            start = clock.now()
            step(tick)
            end = clock.now()
            if n == len(self._rec):
                self._rec = np.concatenate([self._rec, np.zeros_like(self._rec)]) if n else np.zeros((1024, _COLS))
            row = self._rec[n]
            row[0], row[1], row[2], row[3] = start - t0, sched_off, end - start, abs(start - sched)
            n += 1
            self._n = n   # published after the row is written: stats() from another thread stays consistent
            took_ckpt = every and n % every == 0
            if took_ckpt:
                try:
                    session.checkpoint(**self._ckpt_args)
                except Exception as exc:
                    if not keep_going:
                        raise
                    self._checkpoint_failed(exc)
                after = clock.now()
                k = self._n_ckpt
                if k == len(self._stalls):
                    self._stalls = np.concatenate([self._stalls, np.zeros(max(k, 16))])
                self._stalls[k] = after - end
                self._n_ckpt = k + 1
                end = after
            nxt = tick + 1
            nxt_sched = t0 + nxt * period          # == this step's deadline
            if end > nxt_sched:
                self._misses += 1
                if took_ckpt:
                    self._misses_ckpt += 1
                if skip:
                    # first boundary at or after `end`; floor() may land one short through rounding
                    k = max(nxt, int((end - t0) // period))
                    while t0 + k * period < end:
                        k += 1
                    nxt = k
            tick = nxt

    def _checkpoint_failed(self, exc: Exception) -> None:
        """on_checkpoint_error="continue": count the failure; warn on the first of this run."""
        self._ckpt_error = f"{type(exc).__name__}: {exc}"
        self._ckpt_failures += 1
        if self._ckpt_failures == 1:
            warnings.warn(f"ControlLoop: a checkpoint failed ({self._ckpt_error}); the loop keeps running "
                          "(on_checkpoint_error='continue') and retries at the next checkpoint_every step; "
                          "further failures of this run are counted in stats().checkpoint_failures, "
                          "not warned about", RuntimeWarning, stacklevel=4)

    def stats(self) -> LoopStats:
        """Summary of the current (or last) run."""
        n, k = self._n, self._n_ckpt
        rec, stalls = self._rec[:n], self._stalls[:k]
        return LoopStats(
            steps=n, hz=self.hz, period_s=self.period_s,
            step_p50_ms=_ms(rec[:, 2], 50), step_p99_ms=_ms(rec[:, 2], 99), step_max_ms=_ms(rec[:, 2], 100),
            misses=self._misses, missed_ticks=self._missed_ticks, jitter_p99_ms=_ms(rec[:, 3], 99),
            checkpoints=k, checkpoint_stall_p50_ms=_ms(stalls, 50), checkpoint_stall_p99_ms=_ms(stalls, 99),
            checkpoint_stall_max_ms=_ms(stalls, 100), misses_with_checkpoint=self._misses_ckpt,
            checkpoint_failures=self._ckpt_failures, last_checkpoint_error=self._ckpt_error)

    def timings(self) -> dict[str, list[float]]:
        """Raw per-step seconds: step_s, start_s and scheduled_s (offsets from the run's start),
        jitter_s; checkpoint_stall_s has one entry per checkpoint taken."""
        n, k = self._n, self._n_ckpt
        rec = self._rec[:n]
        return {"step_s": rec[:, 2].tolist(), "start_s": rec[:, 0].tolist(), "scheduled_s": rec[:, 1].tolist(),
                "jitter_s": rec[:, 3].tolist(), "checkpoint_stall_s": self._stalls[:k].tolist()}
