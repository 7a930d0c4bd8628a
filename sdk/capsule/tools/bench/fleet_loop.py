"""Part 2 of `capsule bench --suite fleet`: what background replication adds to a 100 Hz control loop.

The control suite's loop, without its chat thread: a ControlLoop (MonotonicClock, skip on a miss)
calls s.act(obs) on a Session holding builtin:gru and an LLM (builtin:tiny, with a short
conversation), with a capsule every CHECKPOINT_EVERY ticks; once without and once with
replicate=. The replicator's uploads (boto3 on its own thread: GIL and CPU) and the S3 server's
work (on the same 2 cores) are what the "with" runs add. The runs alternate in ABBA blocks, each a
fresh Session, so slow drift in machine load hits both alike; each block waits for its first
(whole) capsule to be uploaded before the timed loop, so the loop sees the deltas only.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ...control import ControlLoop, MonotonicClock
from ...fleet import Replication
from ...session import Session
from .control import CHAT_TOKENS, CHECKPOINT_EVERY, KV_POOL_MB, LLM_MODEL, LOOP_POLICY
from .fleet_throughput import remote_bytes, wait_remote
from .timing import percentile

HZ = 100
WARMUP_ACTS = 50


def _block(root: Path, device: str, ticks: int, replicate: Replication | None) -> dict[str, Any]:
    state = np.random.default_rng(1).standard_normal(14).astype(np.float32)
    obs = {"observation.state": state}
    with Session.open(root / uuid.uuid4().hex[:8], model=LLM_MODEL, policy=LOOP_POLICY, device=device,
                      runtime={"kv_pool_mb": KV_POOL_MB}, replicate=replicate) as s:
        s.append("system: you are a robot arm's assistant.\n", stream="chat")
        s.generate(CHAT_TOKENS, stream="chat")
        for _ in range(WARMUP_ACTS):
            s.act(obs)
        s.checkpoint()                                   # the whole first capsule: out of the timed loop
        if replicate is not None and not wait_remote(s, 60):
            raise RuntimeError(f"the first capsule did not reach {replicate.url}: {s.replication}")
        before = s.replication

        def step(tick: int) -> None:
            state[0] = tick * 1e-3                       # a changing observation
            s.act(obs)

        loop = ControlLoop(s, HZ, checkpoint_every=CHECKPOINT_EVERY, clock=MonotonicClock())
        st = loop.run(step, ticks)
        t = loop.timings()
        s.flush()
        caught = wait_remote(s, 30) if replicate is not None else None
        after = s.replication
    stalls = t["checkpoint_stall_s"]
    # a tick's busy time: its step plus the capsule it took (what the deadline sees)
    busy = [d + (stalls[(i + 1) // CHECKPOINT_EVERY - 1] if (i + 1) % CHECKPOINT_EVERY == 0 else 0.0)
            for i, d in enumerate(t["step_s"])]
    out = {"steps": st.steps, "misses": st.misses, "misses_with_checkpoint": st.misses_with_checkpoint,
           "missed_ticks": st.missed_ticks, "step_s": t["step_s"], "busy_s": busy, "stall_s": stalls,
           "jitter_s": t["jitter_s"], "caught_up": caught}
    if replicate is not None and before is not None and after is not None:
        held = [v for e, v in remote_bytes(replicate.url).items() if e > before.remote_epoch]
        out.update(uploaded=after.uploaded - before.uploaded, remote_epoch=after.remote_epoch,
                   remote_bytes=sum(v["pack_bytes"] + v["object_bytes"] for v in held),
                   object_bytes=sum(v["object_bytes"] for v in held), last_error=after.last_error)
    return out


def _summary(blocks: list[dict[str, Any]], replicate: bool) -> dict[str, Any]:
    def q(key: str, p: float) -> float:
        return percentile([v for b in blocks for v in b[key]], p) * 1e3
    out = {"replicate": "on" if replicate else "off", "blocks": len(blocks),
           "steps": sum(b["steps"] for b in blocks), "misses": sum(b["misses"] for b in blocks),
           "misses_with_checkpoint": sum(b["misses_with_checkpoint"] for b in blocks),
           "missed_ticks": sum(b["missed_ticks"] for b in blocks),
           "step_p50_ms": q("step_s", 50), "step_p99_ms": q("step_s", 99), "step_max_ms": q("step_s", 100),
           "busy_p99_ms": q("busy_s", 99), "ckpt_stall_p50_ms": q("stall_s", 50),
           "ckpt_stall_p99_ms": q("stall_s", 99), "jitter_p99_ms": q("jitter_s", 99),
           "block_step_p99_ms": [percentile(b["step_s"], 99) * 1e3 for b in blocks]}   # the spread between blocks
    if replicate:
        out.update(caught_up=all(b["caught_up"] for b in blocks), uploaded=sum(b["uploaded"] for b in blocks),
                   remote_bytes=sum(b["remote_bytes"] for b in blocks),
                   object_bytes=sum(b["object_bytes"] for b in blocks),
                   checkpoints=sum(len(b["stall_s"]) for b in blocks),
                   errors=[b["last_error"] for b in blocks if b["last_error"]])
    return out


def loop_with_and_without(root: Path, device: str, ticks: int, blocks: int, url: str,
                          sign_key: bytes | None, bar: Any = None) -> dict[str, Any]:
    """`ticks` per mode in `blocks` alternating blocks (ABBA); the summaries and their p99 ratios."""
    per = max(1, ticks // blocks)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for b in range(blocks):
        for on in ((False, True) if b % 2 == 0 else (True, False)):
            rep = Replication(f"{url}-{b}", sign_key=sign_key) if on else None
            runs[on].append(_block(root, device, per, rep))
            if bar is not None:
                bar.update(per)
    off, on = _summary(runs[False], False), _summary(runs[True], True)
    return {"hz": HZ, "checkpoint_every": CHECKPOINT_EVERY, "ticks_per_block": per, "without": off, "with": on,
            "step_p99_ratio": on["step_p99_ms"] / off["step_p99_ms"],
            "busy_p99_ratio": on["busy_p99_ms"] / off["busy_p99_ms"]}
