"""GPU-check step `llm_graphs`: builtin:small decode with CUDA graphs vs eager, fp16 and fp32.

Per dtype, one Session with graphs and one without (same seeded weights, same prompts):
1. parity: the same greedy decode in both, each step's logits kept by the bench's step probe;
   max |Δlogits| and argmax agreement over the steps where both had fed the same tokens;
2. step p50 at batch 1 and 4 with LIVE tokens per stream (max_context 8192 on CUDA): the
   graph replays a fixed shape, so its cost should follow the live context, not max_context;
3. capture seconds per bucket;
4. on CUDA, a third Session with graphs and runtime.decode_attention="triton" (the paged decode
   kernel inside the graphs): its parity with eager and its step p50 next to the torch graphs'
   (graphs "on+triton"); its failure is reported as triton_error and leaves the rest standing.
On CPU there are no graphs: the eager half runs (smaller sizes) and graph figures read
"n/a (cpu)". ok: on CUDA, fp32 graph and eager pick the same tokens at every parity step.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ...session import Session
from ..bench.decode import robot_prompt
from ..bench.timing import make_clock, percentile, step_probe

MODEL = "builtin:small"
DTYPES = ("float16", "float32")
BATCHES = (1, 4)
NA = "n/a (cpu)"
# live tokens per stream, max_context, timed steps, parity steps, K/V pool
# (live tokens per stream, max_context, timed steps and untimed warm-up steps per row, parity
# steps, K/V pool); on CPU no parity run: there is no graph to compare with
CUDA_SIZES = {"live": (512, 4096), "max_context": 8192, "steps": 32, "warmup": 2, "parity_steps": 32,
              "kv_pool_mb": 512}
CPU_SIZES = {"live": (128, 512), "max_context": 1024, "steps": 8, "warmup": 2, "kv_pool_mb": 64}
QUICK_CPU_SIZES = {"live": (32, 64), "max_context": 256, "steps": 2, "warmup": 1, "kv_pool_mb": 32}
PARITY_PROMPT = 64


def sizes(device: str, quick: bool) -> dict[str, Any]:
    if device == "cuda":
        return dict(CUDA_SIZES, steps=8, parity_steps=16) if quick else CUDA_SIZES
    return QUICK_CPU_SIZES if quick else CPU_SIZES


def parity_run(s: Session, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode of n tokens after a fixed prompt: (generated ids, each decode step's logits)."""
    s.append(robot_prompt(s.tokenizer, PARITY_PROMPT, seed=7), stream="parity")
    before = len(s.tokens("parity"))
    logits: list[torch.Tensor] = []
    with step_probe(s.engine.runner, lambda: 0.0, outputs=logits):
        s.generate(n, stream="parity")
    ids = s.tokens("parity")[before:]
    s.drop_stream("parity")
    return ids, [x[0] for x in logits]


def parity(graph: tuple[list[int], list[torch.Tensor]], eager: tuple[list[int], list[torch.Tensor]],
           vocab: int) -> dict[str, Any]:
    """Compare step i while both runs fed the same tokens 0..i (the first comes from the prefill)."""
    (tg, lg), (te, le) = graph, eager
    compared, agree, worst = 0, 0, 0.0
    for i, (a, b) in enumerate(zip(lg, le)):
        if tg[:i + 1] != te[:i + 1]:
            break
        compared += 1
        worst = max(worst, (a[:vocab] - b[:vocab]).abs().max().item())
        agree += int(a[:vocab].argmax() == b[:vocab].argmax())
    return {"parity_steps": compared, "argmax_agree": agree / compared if compared else 0.0,
            "max_abs_dlogits": worst, "tokens_equal": tg == te}


def _grow(s: Session, names: list[str], live: int) -> None:
    """Append text to each stream until it holds about `live` tokens (different text per stream)."""
    for i, name in enumerate(names):
        have = len(s.tokens(name)) if name in s.streams() else 0
        if live > have:
            s.append(robot_prompt(s.tokenizer, live - have, seed=1000 * live + i), stream=name)


def step_times(s: Session, device: str, sz: dict[str, Any], graphs: str, dtype: str) -> list[dict[str, Any]]:
    """Batch-1 and batch-4 step latency at each live context (the same streams, grown)."""
    runner = s.engine.runner
    clock = make_clock(torch.device(device))
    batches = [b for b in BATCHES if b <= runner.buckets[-1]]
    names = [f"live-{i}" for i in range(max(batches))]
    rows = []
    for live in sz["live"]:
        _grow(s, names, live)
        for b in batches:
            streams = names[:b]
            s.generate(sz["warmup"], stream=streams)
            context = max(len(s.tokens(n)) for n in streams)
            with step_probe(runner, clock) as samples:
                s.generate(sz["steps"] + 1, stream=streams)
            lat = [dt for n, dt in samples if n == b]
            rows.append({"dtype": dtype, "graphs": graphs, "batch": b, "live_tokens": context,
                         "max_context": runner.max_context, "steps": len(lat),
                         "p50_ms": percentile(lat, 50) * 1e3 if lat else None})
    for n in names:
        s.drop_stream(n)
    return rows


def _open(path: Path, device: str, dtype: str, graphs: bool, sz: dict[str, Any],
          attention: str = "torch") -> Session:
    rt = {"dtype": dtype, "cuda_graphs": graphs, "max_context": sz["max_context"], "kv_pool_mb": sz["kv_pool_mb"],
          "decode_attention": attention}
    return Session.open(path, model=MODEL, device=device, runtime=rt)


def one_dtype(tmp: Path, device: str, dtype: str, sz: dict[str, Any], steps: list[dict[str, Any]]) -> dict:
    """The dtype's figures (capture seconds, parity); its step rows go into `steps`."""
    cuda = device == "cuda"
    runs, fig, vocab = {}, {}, 0
    for graphs in ((True, False) if cuda else (False,)):
        label = ("on" if graphs else "off") if cuda else NA
        with _open(tmp / f"{dtype}-{label[:3]}", device, dtype, graphs, sz) as s:
            runner = s.engine.runner
            if graphs and not runner.uses_graphs:
                raise RuntimeError("cuda_graphs=True, but the runner captured no graph on this device")
            if graphs:
                fig["capture_s"] = {str(b): t for b, t in sorted(runner.capture_seconds.items())}
            if cuda:
                runs[graphs] = parity_run(s, sz["parity_steps"])
                vocab = s.tokenizer.vocab_size
            steps += step_times(s, device, sz, label, dtype)
    if not cuda:
        return {"capture_s": NA, "max_abs_dlogits": NA, "argmax_agree": NA}
    out = {**fig, **parity(runs[True], runs[False], vocab)}
    try:
        with _open(tmp / f"{dtype}-triton", device, dtype, True, sz, "triton") as s:
            out["triton"] = parity(parity_run(s, sz["parity_steps"]), runs[False], vocab)
            steps += step_times(s, device, sz, "on+triton", dtype)
    except Exception as exc:  # noqa: BLE001 - the kernel's first GPU runs: reported, not fatal
        out["triton_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return out


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    sz = sizes(device, quick)
    steps: list[dict[str, Any]] = []
    per_dtype: dict[str, Any] = {}
    errors = []
    with tempfile.TemporaryDirectory(prefix="capsule-gpu-check-") as tmp:
        for dtype in DTYPES:
            try:    # one dtype failing (fp16 on some GPU, say) keeps the other's figures
                per_dtype[dtype] = one_dtype(Path(tmp), device, dtype, sz, steps)
            except Exception as exc:  # noqa: BLE001 - reported as this step's error
                per_dtype[dtype] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                errors.append(f"{dtype}: {type(exc).__name__}: {exc}"[:1000])
    checks = {}
    if device == "cuda":
        checks["fp32_graph_tokens_equal_eager"] = per_dtype["float32"].get("tokens_equal") is True
        checks["fp32_triton_graph_tokens_equal_eager"] = \
            per_dtype["float32"].get("triton", {}).get("tokens_equal") is True
    out = {"ok": not errors and all(checks.values()), "model": MODEL, "sizes": sz, "checks": checks,
           **per_dtype, "step_p50": steps}
    if errors or not all(checks.values()):
        out["error"] = "; ".join(errors + [f"{k} is false" for k, v in checks.items() if not v])
    return out
