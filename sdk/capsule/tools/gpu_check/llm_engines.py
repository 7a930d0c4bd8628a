"""GPU-check step `llm_engines`: each LLM engine besides torch (runtime.llm_engines) against the
torch step on the same model and pool: builtin:small fp32, a prefill through torch, then greedy
decode steps through both.

Per engine: whether it runs here (and why not: onnxruntime-gpu and TensorRT are often absent),
max |Δlogits| over the steps, whether every greedy id agrees, the pool's data_ptr unchanged, and
ms/step for the engine and for torch eager (synchronized, warm-up excluded). An engine that
cannot run here is reported, not failed. ok: every engine that ran matched torch. On CPU the
onnxruntime engine runs (the rehearsal), tensorrt reports that it needs CUDA.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ...errors import EngineUnavailable
from ...llm import load_model
from ...llm.engines import BUILDERS, EngineOptions

MODEL = "builtin:small"
BS, PROMPT = 16, 48
TOL = 1e-3


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def compare(model: Any, engine: Any, steps: int, warmup: int = 2) -> dict[str, Any]:
    dev = model.device
    c = model.cfg
    nb = -(-(PROMPT + steps + warmup) // BS)
    tables = torch.arange(1, nb + 1, device=dev)[None]
    g = torch.Generator(dev).manual_seed(0)
    pool_t = torch.zeros(nb + 1, c.num_layers, 2, BS, c.num_kv_heads, c.head_dim, device=dev)
    ids = torch.randint(0, c.vocab_size, (1, PROMPT), device=dev, generator=g)
    pos = torch.arange(PROMPT, device=dev)[None]
    with torch.no_grad():
        slot = (tables.gather(1, pos // BS) * BS + pos % BS).reshape(-1)
        last = model.lm_head(model(ids, pos, slot, tables, pool_t)[:, -1])
        pool_e = pool_t.clone()
        ptr = pool_e.data_ptr()
        tok = last.argmax(-1, keepdim=True)
        tok_e, worst, same, t_torch, t_engine = tok.clone(), 0.0, True, [], []
        at = pos[:, -1:] + 1
        for i in range(warmup + steps):
            slot = (tables.gather(1, at // BS) * BS + at % BS).reshape(-1)
            _sync(dev)
            t0 = time.perf_counter()
            lt = model.lm_head(model(tok, at, slot, tables, pool_t)[:, -1])
            _sync(dev)
            t1 = time.perf_counter()
            le = model.lm_head(engine(tok_e, at, slot, tables, pool_e)[:, -1])
            _sync(dev)
            t2 = time.perf_counter()
            if i >= warmup:
                t_torch.append(t1 - t0)
                t_engine.append(t2 - t1)
            worst = max(worst, float((lt - le).abs().max()))
            same &= bool(torch.equal(lt.argmax(-1), le.argmax(-1)))
            tok, tok_e, at = lt.argmax(-1, keepdim=True), le.argmax(-1, keepdim=True), at + 1
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return {"ran": True, "max_abs_logit_diff": worst, "greedy_ids_equal": same,
            "pool_in_place": pool_e.data_ptr() == ptr, "steps": steps,
            "engine_ms_per_step_p50": med(t_engine), "torch_eager_ms_per_step_p50": med(t_torch),
            "ok": same and worst < TOL and pool_e.data_ptr() == ptr}


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    dev = torch.device(device)
    model, _ = load_model(MODEL, device=dev)
    model.prepare_rope(512)
    steps = 8 if quick else 32
    engines: dict[str, Any] = {}
    for name in BUILDERS:
        try:
            engine = BUILDERS[name](model, EngineOptions(threads=1 if device == "cpu" else None))
        except EngineUnavailable as exc:
            engines[name] = {"ran": False, "why": str(exc)}
            continue
        try:
            engines[name] = compare(model, engine, steps)
        except Exception as exc:   # noqa: BLE001 - one engine's failure is a figure, not the step's end
            engines[name] = {"ran": True, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    return {"model": MODEL, "dtype": "float32", "engines": engines,
            "ok": all(e.get("ok", True) for e in engines.values() if e["ran"])}
