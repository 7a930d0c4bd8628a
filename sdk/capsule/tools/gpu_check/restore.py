"""GPU-check step `restore`: a capsule restored in place, and in a fresh Session.

One builtin:small stream (a ~1000-token transcript, sized to fit max_context with room for
the continuations) samples a few tokens with a seeded generator, then: checkpoint (durable:
checkpoint_ms), the uninterrupted continuation, rollback (rollback_ms), the continuation
again, which must be the same text (the generator's state is in the capsule too), with every
registered buffer at the same address and no graph captured again (replays still point at
them). Then the Session is closed and opened again on the store: open + restore + first
token (fresh_first_token_ms), whose token must be the continuation's first.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...session import Session
from ..bench.decode import robot_prompt
from ..bench.timing import make_clock

MODEL = "builtin:small"
TRANSCRIPT, QUICK_TRANSCRIPT = 1000, 200     # tokens
CONTINUATION, QUICK_CONTINUATION = 16, 6     # tokens sampled after the checkpoint
MAX_CONTEXT, KV_POOL_MB = 2048, 64
SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def _ms(clock: Callable[[], float], fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = clock()
    out = fn()
    return (clock() - t0) * 1e3, out


def _graph_ids(s: Session) -> dict[str, int]:
    """Identity of each captured graph: a re-capture makes new objects."""
    return {str(b): id(g) for b, g in s.engine.runner.graphs.items()}


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    clock = make_clock(torch.device(device))
    n, more = (QUICK_TRANSCRIPT, QUICK_CONTINUATION) if quick else (TRANSCRIPT, CONTINUATION)
    rt = {"max_context": MAX_CONTEXT, "kv_pool_mb": KV_POOL_MB, "cuda_graphs": device == "cuda"}
    out: dict[str, Any] = {"model": MODEL, "transcript_tokens_target": n, "max_context": MAX_CONTEXT}
    with tempfile.TemporaryDirectory(prefix="capsule-gpu-check-") as tmp:
        path = Path(tmp) / "store"
        with Session.open(path, model=MODEL, device=device, runtime=rt) as s:
            s.append(robot_prompt(s.tokenizer, n, seed=3))
            s.generate(2, seed=11, **SAMPLING)          # the stream's generator now has a state
            out["tokens_at_checkpoint"] = len(s.tokens())
            ptrs, graphs = s.registry.data_ptrs(), _graph_ids(s)
            capture = dict(s.engine.runner.capture_seconds)
            out["checkpoint_ms"], epoch = _ms(clock, s.checkpoint)
            uninterrupted = s.generate(more, **SAMPLING)
            out["rollback_ms"], _ = _ms(clock, lambda: s.rollback(epoch))
            out["first_token_after_rollback_ms"], first = _ms(clock, lambda: s.generate(1, **SAMPLING))
            again = first + s.generate(more - 1, **SAMPLING)
            out["graphs"] = len(graphs)
            checks = {"data_ptrs_unchanged": s.registry.data_ptrs() == ptrs,
                      "graphs_not_recaptured": _graph_ids(s) == graphs
                      and dict(s.engine.runner.capture_seconds) == capture,
                      "continuation_equal": again == uninterrupted}
            s.rollback(epoch)                          # the store's newest epoch is the one to reopen
        t0 = clock()
        with Session.open(path, model=MODEL, device=device, runtime=rt) as s2:
            out["fresh_open_ms"] = (clock() - t0) * 1e3
            fresh = s2.generate(1, **SAMPLING)
            out["fresh_open_restore_first_token_ms"] = (clock() - t0) * 1e3
            checks["fresh_restored_epoch"] = s2.restored_epoch == epoch
            checks["fresh_first_token_equal"] = fresh == first
    out["registered_buffers"] = len(ptrs)
    out["checks"] = checks
    failed = [k for k, v in checks.items() if not v]
    if failed:
        out["error"] = f"restore checks failed: {', '.join(failed)}"
    out["ok"] = not failed
    return out
