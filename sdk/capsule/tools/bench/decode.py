"""`capsule bench --suite decode`: prefill throughput, decode-step latency per batch, memory.

Measured through Session (append, generate) so the numbers are what an app sees; per-step
latency comes from a probe around the runner's decode call. Every measurement follows an
untimed warm-up of the same shape. With CUDA graphs the decode steps are measured again
with graphs off, and the capture time per bucket is reported.
"""
from __future__ import annotations

import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...session import Session
from . import BenchOptions, SuiteResult
from .timing import announcer, make_clock, percentile, progress, step_probe
from . import decode_append
from . import decode_sampling
from . import decode_threads
from . import decode_linears

BATCHES = (1, 2, 4)
DEFAULT_STEPS, QUICK_STEPS = 128, 32       # decode steps timed per batch size
PREFILL_TOKENS, QUICK_PREFILL_TOKENS = (512, 2048), (512,)
PREFILL_REPS, QUICK_PREFILL_REPS = 3, 2
DECODE_CONTEXT = 128                         # prompt tokens per stream before the timed steps
WARMUP_STEPS = 4


def robot_prompt(tokenizer: Any, n_tokens: int, seed: int) -> str:
    """A robot-log-like transcript of at least n_tokens tokens, whole lines, reproducible per seed."""
    rng = random.Random(seed)
    verbs = ("move", "grasp", "place", "scan", "wait", "open", "close", "rotate")
    things = ("red cup", "gripper", "bin 7", "door", "shelf B", "charging dock", "blue box")
    lines: list[str] = []
    while True:
        for _ in range(16):  # a batch of lines between (relatively costly) token counts
            lines.append(f"t={rng.randint(0, 99999):05d} joint{rng.randint(1, 7)}={rng.uniform(-3, 3):.3f} "
                         f"user: {rng.choice(verbs)} the {rng.choice(things)} ({rng.randint(1, 500)} mm)\n")
        text = "".join(lines)
        if len(tokenizer.encode(text)) >= n_tokens:
            break
    while len(lines) > 1 and len(tokenizer.encode("".join(lines[:-1]))) >= n_tokens:
        lines.pop()
    return "".join(lines)


def _prefill(s: Session, lengths: tuple[int, ...], reps: int, clock: Callable[[], float],
             show: bool) -> list[dict[str, Any]]:
    """Time to first token for fresh streams of each prompt length (the whole prompt is prefilled)."""
    s.append(robot_prompt(s.tokenizer, lengths[0], seed=-1), stream="warmup")
    s.generate(1, stream="warmup")
    s.drop_stream("warmup")   # each prompt's K/V goes back to the pool: a real model's is large
    rows = []
    bar = progress(len(lengths) * reps, "prefill", show, unit="prompt")
    for n in lengths:
        times, counts = [], []
        for r in range(reps):
            name = f"prefill-{n}-{r}"
            s.append(robot_prompt(s.tokenizer, n, seed=r), stream=name)
            counts.append(len(s.tokens(name)))
            t0 = clock()
            s.generate(1, stream=name)
            times.append(clock() - t0)
            s.drop_stream(name)
            bar.update(1)
        t, tokens = statistics.median(times), statistics.median(counts)
        rows.append({"prompt_tokens": int(tokens), "ttft_ms_p50": t * 1e3, "tokens_per_s": tokens / t})
    bar.close()
    return rows


def _decode(s: Session, batches: tuple[int, ...], steps: int, clock: Callable[[], float], graphs: str,
            show: bool, tag: str) -> list[dict[str, Any]]:
    """Decode `steps` steps for 1, 2, 4 streams together; per-step latency and generate tokens/s."""
    runner = s.engine.runner  # bench-only look inside: the step probe wraps its decode call
    rows = []
    for b in batches:
        names = [f"{tag}-b{b}-{i}" for i in range(b)]
        for i, name in enumerate(names):
            s.append(robot_prompt(s.tokenizer, DECODE_CONTEXT, seed=100 + i), stream=name)
        s.generate(WARMUP_STEPS, stream=names)
        before = {n: len(s.tokens(n)) for n in names}
        bar = progress(steps, f"decode batch {b} graphs {graphs}", show)
        with step_probe(runner, clock, bar) as samples:
            t0 = clock()
            s.generate(steps + 1, stream=names)  # the first new token comes from the prefill's logits
            wall = clock() - t0
        bar.close()
        made = sum(len(s.tokens(n)) - before[n] for n in names)
        lat = [dt for n, dt in samples if n == b]  # a stream may stop early (EOS): other batch sizes
        rows.append({"batch": b, "graphs": graphs, "steps": len(lat),
                     "p50_ms": percentile(lat, 50) * 1e3 if lat else None,
                     "p99_ms": percentile(lat, 99) * 1e3 if lat else None,
                     "tokens_per_s": made / wall,
                     "context": max(len(s.tokens(n)) for n in names)})
    return rows


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def run(opts: BenchOptions) -> SuiteResult:
    """Run the decode suite on opts.model (builtin:small by default: seeded random, untrained)."""
    steps = opts.steps or (QUICK_STEPS if opts.quick else DEFAULT_STEPS)
    reps = QUICK_PREFILL_REPS if opts.quick else PREFILL_REPS
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="capsule-bench-") as tmp:
        t0 = time.perf_counter()
        s = Session.open(Path(tmp) / "graphs", model=opts.model, device=opts.device)
        results["open_s"] = time.perf_counter() - t0
        runner = s.engine.runner
        device = runner.pool.tensor.device
        clock = make_clock(device)
        lengths = tuple(n for n in (QUICK_PREFILL_TOKENS if opts.quick else PREFILL_TOKENS)
                        if n < runner.max_context)
        batches = tuple(b for b in BATCHES if b <= runner.buckets[-1])
        graphs = "on" if runner.uses_graphs else ("off" if device.type == "cuda" else "n/a")
        settings = {"model": opts.model, "untrained": bool(getattr(s.model_info, "untrained", False)),
                    "profile": s.profile.name, "device": str(device), "dtype": s.profile.runtime.dtype,
                    "batch_buckets": list(runner.buckets), "max_context": runner.max_context,
                    "decode_steps": steps, "decode_context": DECODE_CONTEXT, "warmup_steps": WARMUP_STEPS,
                    "prefill_tokens": list(lengths), "prefill_reps": reps, "quick": opts.quick,
                    "torch_threads": torch.get_num_threads()}
        results["capture_seconds"] = {str(b): t for b, t in sorted(runner.capture_seconds.items())}
        say = announcer("decode", opts.progress)
        say(f"prefill of {', '.join(map(str, lengths))} tokens, then {steps} steps at batch "
            f"{', '.join(map(str, batches))} (graphs {graphs})")
        results["prefill"] = _prefill(s, lengths, reps, clock, opts.progress)
        results["decode"] = _decode(s, batches, steps, clock, graphs, opts.progress, "g")
        s.close()
        if graphs == "on":  # the same steps eagerly: what capturing the graphs buys
            del s, runner
            t0 = time.perf_counter()
            with Session.open(Path(tmp) / "eager", model=opts.model, device=opts.device,
                              runtime={"cuda_graphs": False}) as eager:
                results["open_s_no_graphs"] = time.perf_counter() - t0
                results["decode"] += _decode(eager, batches, steps, clock, "off", opts.progress, "e")
    results["peak_rss_mb"] = _peak_rss_mb()
    results["peak_cuda_allocated_mb"] = (torch.cuda.max_memory_allocated() / 2**20
                                         if device.type == "cuda" else None)
    tables = {"prefill (time to first token)": results["prefill"], "decode steps": results["decode"]}
    if results["capture_seconds"]:
        tables["CUDA graph capture"] = [{"bucket": int(b), "capture_s": t}
                                        for b, t in results["capture_seconds"].items()]
    memory = {"open_s": results["open_s"], "peak_rss_mb": results["peak_rss_mb"]}
    if results["peak_cuda_allocated_mb"] is not None:
        memory["peak_cuda_allocated_mb"] = results["peak_cuda_allocated_mb"]
    tables["open and memory"] = [memory]
    say = announcer("decode", opts.progress)
    say("Session.append and the checkpoint after it")
    decode_append.report(opts, results, tables)
    say("sampling vs greedy at batch 4")
    decode_sampling.report(opts, results, tables)
    say("engines x CPU threads" if device.type == "cpu" else "engines x threads: CPU only, skipped")
    decode_threads.report(opts, results, tables, device, robot_prompt)
    say("weights: dequantized vs int4" if device.type == "cpu" else "weights: CPU only, skipped")
    decode_linears.report(opts, results, tables, device, robot_prompt)
    return SuiteResult(settings=settings, results=results, tables=tables)
