"""ControlLoop: deadline scheduling, miss accounting, capsule stalls, stop, errors.

Scheduling correctness is asserted exactly on a FakeClock (a step 'takes' time by advancing it).
Real-clock tests (MonotonicClock) only check liveness and stay lenient, since CI machines are
shared and a loaded host can oversleep by milliseconds.
"""
from __future__ import annotations

import threading

import pytest

from capsule.control import ControlLoop, FakeClock, LoopStats, MonotonicClock

MS = 1e-3


def stepper(clock: FakeClock, default_ms: float, slow: dict[int, float] | None = None):
    """A step fn that takes default_ms (slow[tick] ms on given ticks) and logs the ticks it ran."""
    ran: list[int] = []

    def step(tick: int) -> None:
        ran.append(tick)
        clock.advance((slow or {}).get(tick, default_ms) * MS)
    step.ran = ran  # type: ignore[attr-defined]
    return step


class FakeSession:
    def __init__(self, clock: FakeClock, stall_ms: float) -> None:
        self.clock, self.stall_ms, self.calls = clock, stall_ms, []

    def checkpoint(self, **kwargs) -> int:
        self.calls.append(kwargs)
        self.clock.advance(self.stall_ms * MS)
        return len(self.calls)


def test_exact_deadline_accounting():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock)
    step = stepper(clock, 3)
    st = loop.run(step, 50)
    assert isinstance(st, LoopStats)
    assert st.steps == 50 and st.misses == 0 and st.missed_ticks == 0 and st.checkpoints == 0
    assert st.hz == 100 and st.period_s == pytest.approx(0.01)
    t = loop.timings()
    assert t["start_s"] == [k * 0.01 for k in range(50)]
    assert t["scheduled_s"] == t["start_s"]
    assert st.jitter_p99_ms == 0.0 and max(t["jitter_s"]) == 0.0
    assert st.step_p50_ms == pytest.approx(3.0, abs=1e-9)
    assert st.step_max_ms == pytest.approx(3.0, abs=1e-9)
    assert step.ran == list(range(50))
    assert clock.now() == pytest.approx(49 * 0.01 + 0.003)  # no sleep after the last step


def test_slow_step_skip_realigns_to_grid():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock)  # on_miss="skip" is the default
    step = stepper(clock, 3, {5: 25})            # tick 5: starts 50 ms, ends 75 ms, deadline 60 ms
    st = loop.run(step, 10)
    assert st.misses == 1
    assert st.missed_ticks == 2                  # ticks 6 and 7 skipped; next start at the 80 ms boundary
    assert step.ran == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    t = loop.timings()
    assert t["start_s"] == [k * 0.01 for k in step.ran]   # back on the k*period grid, no drift
    assert st.jitter_p99_ms == 0.0
    assert st.step_max_ms == pytest.approx(25.0, abs=1e-9)


def test_skip_boundary_exactly_at_end_is_used():
    clock = FakeClock()
    step = stepper(clock, 1, {2: 20})            # tick 2: 20 ms -> ends on the 40 ms boundary exactly
    st = ControlLoop(None, 100, clock=clock).run(step, 5)
    assert step.ran == [0, 1, 2, 4, 5]
    assert st.misses == 1 and st.missed_ticks == 1


def test_missed_ticks_only_count_ticks_that_would_have_run():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock)
    st = loop.run(stepper(clock, 3, {8: 25}), 9)            # the last step overruns: nothing follows
    assert st.misses == 1 and st.missed_ticks == 0
    step = stepper(clock, 3, {8: 25})                       # ends at 105 ms; tick 9 is inside 0.1 s
    st = loop.run(step, duration_s=0.1)
    assert step.ran == list(range(9)) and st.misses == 1 and st.missed_ticks == 1


def test_slow_step_catch_up_runs_late_ticks_then_recovers():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock, on_miss="catch_up")
    step = stepper(clock, 3, {5: 25})
    st = loop.run(step, 10)
    assert step.ran == list(range(10))           # nothing skipped
    assert st.missed_ticks == 0
    t = loop.timings()
    # tick 5 ends 75 ms; 6 runs at once (75-78, deadline 70: miss), 7 (78-81, deadline 80: miss),
    # 8 (81-84, deadline 90: met), 9 back on the grid at 90 ms
    assert t["start_s"][:6] == [k * 0.01 for k in range(6)]
    assert t["start_s"][6:9] == pytest.approx([0.075, 0.078, 0.081], abs=1e-12)
    assert t["start_s"][9] == 0.09
    assert st.misses == 3
    assert st.jitter_p99_ms == pytest.approx(15.0, abs=1e-9)   # tick 6: 75 ms vs 60 ms


def test_checkpoint_stalls_counted_apart_and_wait_false():
    clock = FakeClock()
    session = FakeSession(clock, stall_ms=2)
    loop = ControlLoop(session, 100, checkpoint_every=10, clock=clock)
    st = loop.run(stepper(clock, 3), 100)
    assert st.checkpoints == 10 and len(session.calls) == 10
    assert all(c == {"wait": False} for c in session.calls)
    assert st.checkpoint_stall_p50_ms == pytest.approx(2.0, abs=1e-9)
    assert st.checkpoint_stall_max_ms == pytest.approx(2.0, abs=1e-9)
    assert st.step_max_ms == pytest.approx(3.0, abs=1e-9)   # the stall is not in the step's time
    assert st.misses == 0 and st.misses_with_checkpoint == 0  # 3 + 2 ms < 10 ms
    assert len(loop.timings()["checkpoint_stall_s"]) == 10


def test_checkpoint_miss_only_when_step_plus_stall_exceeds_period():
    clock = FakeClock()
    session = FakeSession(clock, stall_ms=2)
    loop = ControlLoop(session, 100, checkpoint_every=10, clock=clock)
    step = stepper(clock, 9)                       # 9 ms alone meets the deadline, 9 + 2 does not
    st = loop.run(step, 100)
    assert st.checkpoints == 10
    assert st.misses == 10 and st.misses_with_checkpoint == 10
    assert st.missed_ticks == 9    # each capsule step pushes its successor one tick (the 100th has none)
    # the steps that took a capsule are the 10th, 20th, ...: the tick after each is skipped
    ran = step.ran
    for i in range(9, 99, 10):
        assert ran[i + 1] == ran[i] + 2


def test_raising_step_propagates_and_stats_remain():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock)

    def step(tick: int) -> None:
        clock.advance(0.001)
        if tick == 7:
            raise RuntimeError("motor fault")

    with pytest.raises(RuntimeError, match="motor fault"):
        loop.run(step, 20)
    st = loop.stats()
    assert st.steps == 7 and st.misses == 0
    assert len(loop.timings()["step_s"]) == 7
    assert loop.run(lambda t: clock.advance(0.001), 3).steps == 3   # the loop is reusable


def test_duration_limit_and_growth_without_steps():
    clock = FakeClock()
    loop = ControlLoop(None, 1000, clock=clock)
    st = loop.run(lambda t: clock.advance(0.0001), duration_s=3.0)   # 3000 ticks: arrays grow
    assert st.steps == 3000 and st.misses == 0
    assert loop.timings()["start_s"][-1] == pytest.approx(2.999)


@pytest.mark.parametrize("hz, duration, expected", [(100, 0.3, 30), (100, 0.7, 70), (1000, 0.0015, 2),
                                                     (100, 0.0001, 1)])
def test_duration_counts_ticks_scheduled_before_it(hz, duration, expected):
    clock = FakeClock()
    assert ControlLoop(None, hz, clock=clock).run(lambda t: None, duration_s=duration).steps == expected


def test_steps_and_duration_first_limit_wins():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock)
    assert loop.run(lambda t: None, 5, duration_s=1.0).steps == 5
    assert loop.run(lambda t: None, 500, duration_s=0.1).steps == 10


def test_unbounded_run_grows_and_stops_from_step():
    clock = FakeClock()
    loop = ControlLoop(None, 100, clock=clock)

    def step(tick: int) -> None:
        clock.advance(0.001)
        if tick == 2999:
            loop.stop()

    assert loop.run(step).steps == 3000


def test_stop_from_another_thread_real_clock():
    loop = ControlLoop(None, 1000, clock=MonotonicClock())
    result: list[LoopStats] = []
    running, ran = threading.Event(), []

    def step(tick: int) -> None:
        ran.append(tick)
        if len(ran) == 20:
            running.set()
    th = threading.Thread(target=lambda: result.append(loop.run(step)))
    th.start()
    assert running.wait(30)            # a hang guard: 20 ms of steps on an idle machine
    loop.stop()
    th.join(timeout=30)
    assert not th.is_alive() and result and result[0].steps == len(ran) >= 20
    # the loop can never run faster than its rate: no step started before its deadline
    t = loop.timings()
    assert all(a >= s for a, s in zip(t["start_s"], t["scheduled_s"]))
    assert round(t["scheduled_s"][-1] * 1000) == result[0].steps - 1 + result[0].missed_ticks


def test_stop_before_run_returns_immediately():
    loop = ControlLoop(None, 100, clock=FakeClock())
    loop.stop()
    assert loop.run(lambda t: None, 10).steps == 0
    assert loop.run(lambda t: None, 10).steps == 10   # a stop ends only one run


def test_concurrent_run_refused():
    loop = ControlLoop(None, 1000, clock=MonotonicClock(spin_s=0))
    running = threading.Event()
    th = threading.Thread(target=loop.run, args=(lambda t: running.set(),))
    th.start()
    try:
        assert running.wait(5)
        with pytest.raises(RuntimeError, match="already active"):
            loop.run(lambda t: None, 1)
    finally:
        loop.stop()
        th.join(timeout=5)


def test_monotonic_clock_200hz_sanity():
    # Lenient by design (see the module docstring): an idle machine shows 0 misses here, but with
    # every core saturated (measured: 2 cores busy-looping) OS wake-ups come late and ~9 of 100
    # steps miss. Scheduling itself is proven exactly on the FakeClock; here we check the real
    # clock keeps the grid: never early, skipped ticks accounted for, misses a small minority.
    loop = ControlLoop(None, 200, clock=MonotonicClock())
    st = loop.run(lambda tick: None, 100)
    t = loop.timings()
    assert st.steps == 100
    assert st.misses <= 25
    assert all(a >= s for a, s in zip(t["start_s"], t["scheduled_s"]))   # deadline sleep: never early
    assert round(t["scheduled_s"][-1] * 200) == 99 + st.missed_ticks


def test_fake_clock_never_goes_backwards():
    c = FakeClock(5.0)
    c.sleep_until(1.0)
    assert c.now() == 5.0
    c.sleep_until(6.0)
    assert c.now() == 6.0
    with pytest.raises(ValueError):
        c.advance(-1)


@pytest.mark.parametrize("kwargs, match", [
    ({"hz": 0}, "hz must be"), ({"hz": -5}, "hz must be"), ({"hz": 20000}, "<= 10000"),
    ({"hz": True}, "hz must be"), ({"hz": float("nan")}, "hz must be"),
    ({"checkpoint_every": -1}, "checkpoint_every"), ({"checkpoint_every": 2.5}, "checkpoint_every"),
    ({"on_miss": "drop"}, "'skip', 'catch_up'"),
    *[({"checkpoint_every": 1, "on_checkpoint_error": bad}, "on_checkpoint_error must be one of 'raise', "
       "'continue'") for bad in ("ignore", "", None, True, "RAISE")],
])
def test_bad_constructor_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControlLoop(FakeSession(FakeClock(), 0), **kwargs)


def test_bad_session_and_run_args():
    with pytest.raises(ValueError, match="checkpoint"):
        ControlLoop(object(), 100, checkpoint_every=5)
    loop = ControlLoop(None, 100, clock=FakeClock())
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="steps must be"):
            loop.run(lambda t: None, bad)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="duration_s must be"):
            loop.run(lambda t: None, duration_s=bad)
    with pytest.raises(ValueError, match="spin_s"):
        MonotonicClock(spin_s=-0.1)


class FailingSession(FakeSession):
    """checkpoint raises on the given call numbers (1-based), as a full disk would."""

    def __init__(self, clock: FakeClock, stall_ms: float, fail_on: set[int]) -> None:
        super().__init__(clock, stall_ms)
        self.fail_on = fail_on

    def checkpoint(self, **kwargs) -> int:
        n = super().checkpoint(**kwargs)
        if n in self.fail_on:
            raise OSError(f"injected: no space left on device (call {n})")
        return n


def test_checkpoint_failure_raises_by_default():
    clock = FakeClock()
    loop = ControlLoop(FailingSession(clock, 1, {3}), 100, checkpoint_every=5, clock=clock)
    assert loop.on_checkpoint_error == "raise"
    with pytest.raises(OSError, match="no space left"):
        loop.run(stepper(clock, 2), 50)
    st = loop.stats()
    assert st.steps == 15 and st.checkpoints == 2 and st.checkpoint_failures == 0


def test_checkpoint_failure_continue_keeps_acting_counts_and_warns_once():
    clock = FakeClock()
    session = FailingSession(clock, 1, {3, 4, 7})
    loop = ControlLoop(session, 100, checkpoint_every=5, clock=clock, on_checkpoint_error="continue")
    step = stepper(clock, 2)
    with pytest.warns(RuntimeWarning, match="checkpoint failed") as caught:
        st = loop.run(step, 50)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1   # once per run
    assert "call 3" in str(caught[0].message) and "continue" in str(caught[0].message)
    assert st.steps == 50 and step.ran == list(range(50))     # the robot never stopped acting
    assert len(session.calls) == 10 and st.checkpoints == 10  # later capsules were still taken
    assert st.checkpoint_failures == 3
    assert st.last_checkpoint_error == "OSError: injected: no space left on device (call 7)"
    assert st.misses == 0 and len(loop.timings()["checkpoint_stall_s"]) == 10
    session.fail_on = {11}
    with pytest.warns(RuntimeWarning, match="call 11"):      # each run warns on its first failure
        assert loop.run(step, 10).checkpoint_failures == 1
    session.fail_on = set()
    st = loop.run(step, 10)                                   # a new run starts its counts afresh
    assert st.checkpoint_failures == 0 and st.last_checkpoint_error is None
