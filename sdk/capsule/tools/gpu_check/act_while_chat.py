"""GPU-check step `act_while_chat`: Session.act latency while a chat thread generates.

One Session holds builtin:gru and an LLM (builtin:small on CUDA, so a decode step is real GPU
work; the control bench's builtin:tiny on CPU). act is called every PERIOD_S for DURATION_S,
first alone, then while the control bench's ChatThread appends and generates on stream
"chat" of the same Session. act takes only the policy lock, so it should never wait for a
generate; on CUDA it also must not queue behind the decode's kernels. Figures: act p50 / p99
/ max µs in both phases, chat turns, and how many acts ran during a generate call.
ok: the chat thread ran without error and at least one act overlapped a generate.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...session import Session
from ..bench.control import KV_POOL_MB, LLM_MODEL, LOOP_POLICY, ChatThread
from ..bench.timing import percentile

PERIOD_S = 1e-3
DURATION_S, QUICK_DURATION_S = 4.0, 1.5
CUDA_LLM = "builtin:small"


def _acts(s: Session, duration_s: float) -> list[tuple[float, float]]:
    """(start, end) perf_counter of each act, one every PERIOD_S on a fixed grid."""
    state = np.random.default_rng(2).standard_normal(14).astype(np.float32)
    obs = {"observation.state": state}
    spans: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    k = 0
    while time.perf_counter() - t0 < duration_s:
        state[0] = k * 1e-3                      # a changing observation
        a = time.perf_counter()
        s.act(obs)
        spans.append((a, time.perf_counter()))
        k += 1
        time.sleep(max(0.0, t0 + k * PERIOD_S - time.perf_counter()))
    return spans


def _stats(spans: list[tuple[float, float]]) -> dict[str, float]:
    lat = [b - a for a, b in spans]
    return {"acts": len(lat), "p50_us": percentile(lat, 50) * 1e6, "p99_us": percentile(lat, 99) * 1e6,
            "max_us": max(lat) * 1e6}


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    llm = CUDA_LLM if device == "cuda" else LLM_MODEL
    duration = QUICK_DURATION_S if quick else DURATION_S
    with tempfile.TemporaryDirectory(prefix="capsule-gpu-check-") as tmp:
        with Session.open(Path(tmp) / "s", model=llm, policy=LOOP_POLICY, device=device,
                          runtime={"kv_pool_mb": KV_POOL_MB}) as s:
            s.append("system: you are a robot arm's assistant.\n", stream="chat")
            s.generate(4, stream="chat")                 # warm-up, untimed
            _acts(s, 0.1)
            quiet = _acts(s, duration)
            talker = ChatThread(s, seed=1)
            talker.start()
            try:
                busy = _acts(s, duration)
            finally:
                talker.stop.set()
                talker.join()
            engine = s.policy_engine
    if talker.error is not None:
        raise RuntimeError(f"the chat thread failed: {talker.error!r}") from talker.error
    gens = [(a, b) for name, a, b in talker.calls if name == "generate"]
    during = [sp for sp in busy if any(a < sp[1] and b > sp[0] for a, b in gens)]
    out: dict[str, Any] = {
        "llm": llm, "policy": LOOP_POLICY, "engine": engine, "period_us": PERIOD_S * 1e6,
        "quiet": _stats(quiet), "with_chat": _stats(busy),
        "during_generate": _stats(during) if during else None,
        "chat_turns": len(gens), "chat_generate_p50_ms": percentile([b - a for a, b in gens], 50) * 1e3
        if gens else None}
    out["ok"] = bool(during)
    if not during:
        out["error"] = "no act ran while the chat thread generated: nothing was measured under load"
    return out
