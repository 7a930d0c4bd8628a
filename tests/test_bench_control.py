"""The control benchmark suite runs end to end on tiny step counts; miss attribution on a fake clock.

Structure only: timing targets belong in the benchmark's report, not in tests.
"""
from __future__ import annotations

import json

from capsule.tools.bench import SUITES, BenchOptions, run_suite
from capsule.tools.bench.control import _attribute
from capsule.control import ControlLoop, FakeClock


def test_control_suite_quick(tmp_path):
    assert "control" in SUITES
    run = run_suite("control", BenchOptions(model="builtin:tiny", device="cpu", quick=True, steps=40,
                                            progress=False), out_dir=tmp_path)
    data = json.loads(run.json_path.read_text())
    md = run.md_path.read_text()
    for title in ("policy step latency", "control loops", "targets"):
        assert f"## {title}" in md and data["tables"][title]
    settings = data["settings"]
    assert settings["loop_steps"] == {"100": 40, "500": 40} and settings["latency_steps"] == 40
    assert "chat" in settings["chat_thread"] and settings["loadavg_before"]

    lat = data["results"]["latency"]
    ok = {(r["policy"], r["engine"]) for r in lat if r["path"] == "PolicyRunner.step" and r["status"].startswith("ok")}
    for policy in ("builtin:mlp", "builtin:mlp-chunk", "builtin:gru"):
        assert {(policy, "torch"), (policy, "onnxruntime")} <= ok
        rows = [r for r in lat if r["policy"] == policy]
        assert {r["engine"] for r in rows if r["path"] == "PolicyRunner.step"} == {"torch", "onnxruntime", "tensorrt"}
        assert sum(r["path"] == "Session.act" for r in rows) == 1
        for r in rows:
            if r["status"].startswith("ok"):
                assert r["steps"] == 40 and 0 <= r["p50_us"] <= r["p99_us"] <= r["max_us"]
            else:   # an engine that cannot load here says why
                assert r["status"].startswith("skipped: ") and len(r["status"]) > 10 and r["p50_us"] is None

    loops = data["results"]["loops"]
    keys = {(r["hz"], r["chat"], r["capsules"]) for r in loops}
    assert keys == {(hz, chat, caps) for hz in (100, 500) for chat in ("on", "off") for caps in ("off", "every 10")}
    for r in loops:
        assert r["steps"] == 40 and r["engine"] in ("onnxruntime", "torch", "tensorrt")
        assert r["checkpoints"] == (4 if r["capsules"] == "every 10" else 0)
        for k in ("misses", "misses_with_checkpoint", "misses_by_checkpoint", "misses_late_start",
                  "misses_during_chat", "misses_during_writer", "missed_ticks", "chat_turns"):
            assert isinstance(r[k], int) and r[k] >= 0, k
        assert r["misses_with_checkpoint"] <= r["misses"] and r["misses_by_checkpoint"] <= r["misses_with_checkpoint"]
        for k in ("step_p50_ms", "step_p99_ms", "step_max_ms", "jitter_p99_ms", "ckpt_stall_p50_ms",
                  "ckpt_stall_p99_ms", "ckpt_stall_max_ms", "flush_ms", "writer_busy_pct"):
            assert r[k] >= 0, k
        assert r["step_p50_ms"] <= r["step_p99_ms"] <= r["step_max_ms"]
        if r["capsules"] == "off":
            assert r["writer_busy_pct"] == 0 and r["misses_during_writer"] == 0
        if r["chat"] == "off":
            assert r["chat_turns"] == 0 and r["misses_during_chat"] == 0 and r["chat_generate_p50_ms"] is None
    targets = data["results"]["targets"]
    assert len(targets) == 2 and all(t["met"] in ("yes", "NO") for t in targets)
    assert all("100 Hz" in t["target"] for t in targets)


class _LateClock(FakeClock):
    """A FakeClock whose n-th sleep overshoots by `late` seconds (a late wake-up)."""

    def __init__(self, late_at: int, late: float) -> None:
        super().__init__()
        self.calls, self.late_at, self.late = 0, late_at, late

    def sleep_until(self, t: float) -> None:
        super().sleep_until(t)
        self.calls += 1
        if self.calls == self.late_at:
            self.advance(self.late)


class _Session:
    def __init__(self, clock: FakeClock, stalls: list[float]) -> None:
        self.clock, self.stalls = clock, stalls

    def checkpoint(self, wait: bool = True) -> int:
        self.clock.advance(self.stalls.pop(0))
        return 0


def test_attribute_sorts_misses_by_cause():
    # 100 Hz, capsules every 4 steps; step index 2 is slow by itself (during a chat call),
    # index 3's checkpoint stall pushes it past the deadline, index 5 wakes up late
    clock = _LateClock(late_at=6, late=0.0095)
    loop = ControlLoop(_Session(clock, [0.0095, 0.0]), 100, checkpoint_every=4, clock=clock)
    n = []

    def step(tick: int) -> None:
        clock.advance(0.012 if len(n) == 2 else 0.001)
        n.append(tick)

    st = loop.run(step, 8)
    assert (st.misses, st.misses_with_checkpoint, st.checkpoints) == (3, 1, 2)
    spans = {"chat": [("generate", 0.025, 0.028), ("append", 0.2, 0.3)], "writer": [("sync", 0.045, 0.046)]}
    assert _attribute(loop, 0.0, spans) == {"misses_by_checkpoint": 1, "misses_late_start": 1,
                                            "misses_during_chat": 1, "misses_during_writer": 1}
    assert _attribute(loop, 1.0, spans)["misses_during_chat"] == 0   # spans now before the run
