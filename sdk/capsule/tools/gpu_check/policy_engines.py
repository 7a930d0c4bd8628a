"""GPU-check step `policy_engines`: every registered policy engine on this device.

For builtin:mlp, builtin:mlp-chunk and builtin:gru, each engine of the registry is loaded
alone (load_policy(engines=(name,))); one that cannot run here is listed with its reason.
One that runs is compared with the policy's torch module on the CPU in float32 (hidden state
threaded by hand, as a user would) over OBS steps, and timed (the control bench's timer).
ok: every policy ran on at least one engine, and every engine that ran is within TOLERANCE.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...policy import builtin_policy, load_policy, registry
from ...session import Session
from ..bench.control import POLICIES, time_calls

OBS = 50
TOLERANCE = 1e-4          # max |action - reference|: float32 engines, TF32 off
STEPS, WARMUP, QUICK_STEPS, QUICK_WARMUP = 2000, 200, 200, 20


def observations(n: int, dim: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [{"observation.state": rng.standard_normal(dim).astype(np.float32)} for _ in range(n)]


def reference(name: str, obs: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The builtin module on the CPU in float32, its hidden state carried step to step."""
    module = builtin_policy(name.removeprefix("builtin:"))
    spec = module.spec()
    hidden = torch.zeros(1, *spec.hidden_shape) if spec.hidden_shape else None
    want = []
    with torch.no_grad():
        for o in obs:
            action, hidden = module({k: torch.from_numpy(v)[None] for k, v in o.items()}, hidden)
            want.append(action[0].numpy())
    return np.stack(want)


def _one(src: str, engine: str, device: str, obs: list[dict[str, np.ndarray]], want: np.ndarray,
         steps: int, warmup: int) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": src, "engine": engine}
    try:
        runner = load_policy(src, device=device, engines=(engine,))
    except Exception as exc:  # noqa: BLE001 - an engine that cannot run here is a finding, not a failure
        return {**row, "ran": False, "detail": str(exc).split(f"{engine}: ", 1)[-1].splitlines()[0][:300],
                "max_err": None, "p50_us": None, "p99_us": None}
    got = np.stack([runner.step(o) for o in obs])
    err = float(np.abs(got - want).max())
    runner.reset_state()
    t = time_calls(runner.step, obs[0], steps, warmup)
    return {**row, "ran": True, "detail": runner.engine_detail, "max_err": err,
            "p50_us": t["p50_us"], "p99_us": t["p99_us"]}


def session_engine(device: str) -> str:
    """The engine Session.act runs builtin:gru on here: the first of the profile's list that loads."""
    with tempfile.TemporaryDirectory(prefix="capsule-gpu-check-") as tmp:
        with Session.open(Path(tmp) / "s", model=None, policy="builtin:gru", device=device) as s:
            return s.policy_engine


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if quick else (STEPS, WARMUP)
    rows = []
    for src in POLICIES:
        obs = observations(OBS, builtin_policy(src.removeprefix("builtin:")).spec().observation[
            "observation.state"][0][0])
        want = reference(src, obs)
        rows += [_one(src, eng, device, obs, want, steps, warmup) for eng in registry.engine_names()]
    problems = [f"{p}: no engine ran" for p in POLICIES if not any(r["ran"] for r in rows if r["policy"] == p)]
    problems += [f"{r['policy']} on {r['engine']}: max error {r['max_err']:.2e} > {TOLERANCE:g}"
                 for r in rows if r["ran"] and r["max_err"] > TOLERANCE]
    out: dict[str, Any] = {"ok": not problems, "tolerance": TOLERANCE, "obs_steps": OBS, "timed_steps": steps,
                           "session_act_engine": session_engine(device), "engines": rows}
    if problems:
        out["error"] = "; ".join(problems)
    return out
