"""The decode suite's weights table: a quantized GGUF's layers multiplied dequantized (float32, the
default) vs kept int4 (``runtime={"linears": "int4"}``, capsule.llm.int4_linear), each with the
default decode attention ("auto": the C kernel on CPU) and with torch's (gather + SDPA), at 1 and
2 threads: prefill tokens/s, decode ms/token at batch 1 per context, batch 4 per token and its
ratio to batch 1, and how far int4's logits are from the dequantized model's. Under the default
attention each weights kind also runs with a bf16 K/V pool (runtime.kv_dtype, a profile's choice):
at 2,048 tokens a step of four streams reads ~4x a stream's K/V, so the pool's bytes set how far
batch 4 can get below batch 1 (llama.cpp's own default K/V cache is F16).

Each (linears, attention, kv dtype, threads) cell is a fresh Session; cells are interleaved rep by
rep so drift and the neighbours' load fall on all alike, after an untimed warm-up of the same
shapes. Skipped (with the reason recorded) for a model with no Q4_0 / Q4_1 layer, and off CPU.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import ModelLoadError
from ...llm import BlockTable, KVPool, load_model
from ...session import Session
from . import BenchOptions
from .timing import make_clock, percentile, progress, step_probe

LINEARS = ("dequantized", "int4")
ATTENTION = ("auto", "torch")    # runtime.decode_attention: the default, and torch's for comparison
KV_DTYPES = ("float32", "bfloat16")   # runtime.kv_dtype: the default (the weights'), and half the bytes
THREADS = (1, 2)
CONTEXTS, QUICK_CONTEXTS = (512, 2048), (512,)
BATCH = 4
STEPS, QUICK_STEPS = 24, 6
REPS, QUICK_REPS = 2, 1
DEVIATION_TOKENS = 256
KV_POOL_MB = 512                 # 4 streams of 2,048 tokens of a 135M model: ~380 MB of fp32 K/V
Prompt = Callable[[Any, int, int], str]
Cell = tuple[str, str, str, int]   # (linears, attention, kv dtype, threads)


def cells(cores: int) -> list[Cell]:
    """Every (linears, attention, kv dtype, threads) measured: the bf16 pool only under the
    default attention (torch's rows are there to compare kernels, not pools)."""
    return [(lin, att, kv, t) for lin in LINEARS for att in ATTENTION for kv in KV_DTYPES for t in THREADS
            if t <= cores and (kv == KV_DTYPES[0] or att == ATTENTION[0])]


def _cell(s: Session, rep: int, contexts: tuple[int, ...], steps: int, prompt: Prompt) -> dict[str, Any]:
    """Prefill seconds of the last context's prompt, batch-1 step seconds per context, batch-4
    step seconds at the last context, and the batch-1 greedy ids at the first."""
    clock = make_clock(torch.device("cpu"))
    out: dict[str, Any] = {"steps": {}, "ids": None}
    for c in contexts:
        names = [f"lin-{rep}-{c}-{i}" for i in range(BATCH if c == contexts[-1] else 1)]
        for i, name in enumerate(names):
            s.append(prompt(s.tokenizer, c, 7 + i), stream=name)
        t0 = clock()
        s.generate(1, stream=names[0])
        out["prefill"] = (len(s.tokens(names[0])), clock() - t0)
        with step_probe(s.engine.runner, clock, None) as samples:
            s.generate(steps + 1, stream=names[0])
        out["steps"][c] = [dt for n, dt in samples if n == 1]
        if c == contexts[0]:
            out["ids"] = s.tokens(names[0])[-(steps + 2):]
        if len(names) > 1:
            s.generate(1, stream=names[1:])
            with step_probe(s.engine.runner, clock, None) as batched:
                s.generate(steps + 1, stream=names)
            out["batched"] = [dt for n, dt in batched if n == BATCH]
        for name in names:
            s.drop_stream(name)
    return out


def deviation(model: str, tokenizer: str | None, prompt: Prompt, n_tokens: int = DEVIATION_TOKENS) -> dict[str, Any]:
    """int4 logits against the dequantized model's over every position of one prompt."""
    deq, info = load_model(model, own_tokenizer=tokenizer is None)
    q4, _ = load_model(model, own_tokenizer=False, linears="int4")
    from ...tokenize import load_reference
    tok = load_reference(tokenizer or info.tokenizer_path, prefetch=False)
    ids = torch.tensor([tok.encode(prompt(tok, n_tokens, 3))[:n_tokens]])
    want, got = _logits(deq, ids), _logits(q4, ids)
    dev = (got - want).abs()
    return {"prompt_tokens": ids.shape[1], "max_abs_logit_dev": dev.max().item(),
            "mean_abs_logit_dev": dev.mean().item(),
            "max_dev_over_max_logit": dev.max().item() / want.abs().max().item(),
            "argmax_agree_pct": 100.0 * (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    T = ids.shape[1]
    pool = KVPool(model.cfg, pool_bytes=model.cfg.kv_bytes_per_token * 4 * (T + 16), block_size=16,
                  dtype=torch.float32, device="cpu")
    table = BlockTable(pool)
    table.ensure_capacity(T)
    model.prepare_rope(T)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(T).view(1, -1), torch.tensor(table.slots(0, T)),
                       torch.tensor([table.blocks]), pool.tensor)
        return model.lm_head(hidden[0]).float()                          # (T, V)


def measure(opts: BenchOptions, prompt: Prompt, tokenizer: str | None = None,
            show: bool = True, after_rep: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Rows per (linears, attention, kv dtype, threads), the deviation, and the default attention's
    and pool's greedy ids at the first context ("greedy": {"int4/1": ids, ...}); {"skipped": why}
    when int4 cannot load. after_rep(r): called after every cell's timed rep r (the peers suite
    measures llama.cpp's rep r there, so drift in the machine's load falls on both alike)."""
    contexts = QUICK_CONTEXTS if opts.quick else CONTEXTS
    steps = opts.steps or (QUICK_STEPS if opts.quick else STEPS)
    steps = min(steps, QUICK_STEPS if opts.quick else STEPS)
    reps = QUICK_REPS if opts.quick else REPS
    try:
        dev = deviation(opts.model, tokenizer, prompt)
    except ModelLoadError as exc:
        return {"skipped": str(exc)}
    todo = cells(os.cpu_count() or 1)
    got: dict[Cell, list[dict[str, Any]]] = {c: [] for c in todo}
    before = torch.get_num_threads()   # process-wide: give it back afterwards
    bar = progress(len(todo) * (reps + 1), "linears x attention x kv x threads", show, unit="rep")
    kinds: dict[str, str] = {}
    steps_run: dict[tuple[str, str, str], str] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="capsule-bench-linears-") as tmp:
            sessions = {(lin, att, kv, t): Session.open(
                Path(tmp) / f"{lin}-{att}-{kv}-{t}", model=opts.model, tokenizer=tokenizer, device="cpu",
                runtime={"threads": t, "linears": lin, "decode_attention": att, "kv_pool_mb": KV_POOL_MB,
                         "kv_dtype": kv})
                for lin, att, kv, t in todo}
            kinds = {att: s.engine.runner.model.decode_attention for (_, att, _, _), s in sessions.items()}
            steps_run = {(lin, att, kv): s.engine.runner.model.decode_step
                         for (lin, att, kv, _), s in sessions.items()}
            try:
                for r in range(-1, reps):      # rep -1: the untimed warm-up
                    for c, s in sessions.items():
                        torch.set_num_threads(c[3])
                        cell = _cell(s, r, contexts, steps, prompt)
                        if r >= 0:
                            got[c].append(cell)
                        bar.update(1)
                    if r >= 0 and after_rep is not None:
                        after_rep(r)
            finally:
                for s in sessions.values():
                    s.close()
    finally:
        torch.set_num_threads(before)
        bar.close()
    return {"rows": _rows(got, contexts, kinds, steps_run), "deviation": dev, "cores": os.cpu_count(),
            "greedy": {f"{lin}/{t}": runs[0]["ids"] for (lin, att, kv, t), runs in got.items()
                       if att == ATTENTION[0] and kv == KV_DTYPES[0]},
            "load_average_1m": _load(), "reps": reps, "steps": steps}


def _rows(got: dict[Cell, list[dict[str, Any]]], contexts: tuple[int, ...],
          kinds: dict[str, str], steps_run: dict[tuple[str, str, str], str]) -> list[dict[str, Any]]:
    """One row per cell; "attention" is the setting, "kernel" what it resolved to, "step" the
    decode step it ran (runtime.decode_step "auto": "fused" or "layers"), "kv" the pool's dtype;
    greedy ids are compared with the dequantized model's under the same attention and pool, and
    with the same weights' under the fp32 pool."""
    def ms(v: list[float], per: int = 1) -> float | None:
        return percentile(v, 50) * 1e3 / per if v else None
    rows = []
    for (lin, att, kv, t), runs in got.items():
        base = got[("dequantized", att, kv, t)][0]["ids"]
        row: dict[str, Any] = {"linears": lin, "attention": att, "kernel": kinds.get(att, att),
                               "step": steps_run.get((lin, att, kv), "?"), "kv": kv, "threads": t,
                               "prefill_tokens": runs[0]["prefill"][0],
                               "prefill_tokens_per_s": runs[0]["prefill"][0]
                               / statistics.median(c["prefill"][1] for c in runs)}
        for c in contexts:
            row[f"b1_ms_ctx{c}"] = ms([dt for cell in runs for dt in cell["steps"][c]])
        b1 = row[f"b1_ms_ctx{contexts[-1]}"]
        b4 = ms([dt for cell in runs for dt in cell.get("batched", [])], BATCH)
        row[f"b{BATCH}_ms_per_token_ctx{contexts[-1]}"] = b4
        row[f"b{BATCH}_vs_b1"] = b4 / b1 if b4 and b1 else None
        ids = runs[0]["ids"]
        row["greedy_tokens"] = len(ids)
        row["greedy_same_as_dequantized"] = lead(ids, base)
        row["greedy_same_as_fp32_kv"] = lead(ids, got[(lin, att, KV_DTYPES[0], t)][0]["ids"])
        rows.append(row)
    return rows


def lead(a: list[int], b: list[int]) -> int:
    """How many leading ids two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def report(opts: BenchOptions, results: dict[str, Any], tables: dict[str, list[dict[str, Any]]],
           device: torch.device, prompt: Prompt) -> None:
    """The decode suite's hook: on CPU, int4 vs dequantized weights into results and tables."""
    if device.type != "cpu":
        return
    results["linears"] = m = measure(opts, prompt, show=opts.progress)
    if "skipped" in m:
        return
    load = m["load_average_1m"]
    tables[f"weights x decode attention x K/V: dequantized vs int4, auto vs torch, fp32 vs bf16 pool "
           f"({m['cores']} cores, load average "
           f"{'n/a' if load is None else f'{load:.2f}'} at the start)"] = m["rows"]
    tables["int4 logits vs the dequantized model's"] = [m["deviation"]]
