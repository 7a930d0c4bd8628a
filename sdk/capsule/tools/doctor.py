"""`capsule doctor`: which backends really work here, each shown by running a tiny real inference.

Every probe imports its backend lazily and runs inside a guard, so a broken or missing
backend becomes one FAILED or MISSING line, never a crash of the command. The torch probes
live here (they open a Session); each policy engine's probe comes from policy/registry.py; the
LLM engine "onnxruntime" is checked against the torch step.
The torch cpu probe adds a "cpu load" line: WARN when other processes already keep the cores
busy that the session's threads would need (a decode step then waits for a core).
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

from ..policy.probe import FAILED, MISSING, OK, Check, NeedsPackage, Probe, exact_probe_tensors
from ..policy import registry
from .doctor_kernels import probe_decode_kernel, probe_f32_kernel, probe_int4_kernel

__all__ = ["FAILED", "MISSING", "OK", "WARN", "Check", "NeedsPackage", "Probe", "cpu_load_check", "cpu_works",
           "default_probes", "format_checks", "probe_decode_kernel", "probe_f32_kernel", "probe_int4_kernel",
           "probe_policy", "run_checks"]

WARN = "WARN"   # works, but something here will slow it down (the reason says what to change)


def _matmul_error(device: str) -> float:
    import torch

    linear, x = exact_probe_tensors()
    with torch.no_grad():
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        got = linear.to(device)(x.to(device)).double().cpu()
    return float((got - want).abs().max())


def _session_tokens(work: Path, device: str, n: int = 8) -> tuple[float, str]:
    """Open builtin:tiny on `device` and time n greedy tokens (n - 1 decode steps); s/token and mode."""
    from ..session import Session

    with Session.open(work / f"session-{device}", model="builtin:tiny", device=device,
                      runtime={"kv_pool_mb": 16}) as s:
        s.append("doctor: ping\n")
        s.generate(1)                     # prefill first, so the timing below is decode steps
        t0 = time.perf_counter()
        s.generate(n)
        per_token = (time.perf_counter() - t0) / n
        return per_token, "graphs on" if s.engine.runner.uses_graphs else "eager"


def cpu_load_check(threads: int | None = None) -> Check:
    """"cpu load": WARN when the 1-minute load average exceeds the cores the session leaves
    free (os.cpu_count() minus its threads: `threads`, else the detected profile's
    runtime.threads, else torch's count); OK otherwise, or when the OS has no load average."""
    import torch

    if threads is None:
        import devices

        threads = devices.detect_profile("auto").runtime.threads or torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):   # not on every OS (Windows)
        return Check("cpu load", OK, "-", "no load average on this OS")
    free = max(cores - threads, 0)
    text = f"1-min load {load:.2f}; {cores} cores, the session uses {threads} thread(s), {free} free"
    if load > free:
        return Check("cpu load", WARN, "-", f"{text}: other processes compete for the session's cores, "
                     "so steps wait for a core; open with runtime={\"threads\": 1} (or fewer threads "
                     "than the cores left idle)")
    return Check("cpu load", OK, "-", text)


def probe_torch_cpu(work: Path) -> list[Check]:
    import torch

    load = cpu_load_check()   # before the probe's own session adds to the load
    err = _matmul_error("cpu")
    if err > 1e-5:
        return [Check("torch cpu", FAILED, torch.__version__, f"matmul off by {err:.2e}"), load]
    step, mode = _session_tokens(work, "cpu")
    return [Check("torch cpu", OK, torch.__version__,
                  f"matmul exact; builtin:tiny via Session {step * 1e3:.1f} ms/token ({mode}, "
                  f"{torch.get_num_threads()} threads)"), load]


def _no_cuda(name: str) -> Check | None:
    import torch

    if torch.cuda.is_available():
        return None
    why = "torch has no CUDA build" if torch.version.cuda is None else "torch.cuda.is_available() is False"
    return Check(name, MISSING, torch.version.cuda or "-", why)


def probe_torch_cuda(work: Path) -> Check:
    import torch

    missing = _no_cuda("torch cuda")
    if missing:
        return missing
    name = torch.cuda.get_device_name(0)
    err = _matmul_error("cuda")
    if err > 1e-5:
        return Check("torch cuda", FAILED, torch.version.cuda, f"{name}: matmul off by {err:.2e}")
    step, mode = _session_tokens(work, "cuda")
    major, minor = torch.cuda.get_device_capability(0)
    return Check("torch cuda", OK, torch.version.cuda,
                 f"{name} (sm_{major}{minor}); matmul exact; builtin:tiny via Session "
                 f"{step * 1e3:.2f} ms/token ({mode})")


def probe_cuda_graphs(work: Path) -> Check:
    import torch

    missing = _no_cuda("cuda graphs")
    if missing:
        return missing
    from ..cudagraph import capture_graph

    x = torch.zeros(64, device="cuda")
    y = torch.zeros(64, device="cuda")
    t0 = time.perf_counter()   # the runtime's own capture (warm-up included), in its modes
    graph = capture_graph(lambda: y.copy_(x * 2 + 1), x.device)
    capture = time.perf_counter() - t0
    x.copy_(torch.arange(64, dtype=torch.float32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(y.cpu(), torch.arange(64, dtype=torch.float32) * 2 + 1)
    return Check("cuda graphs", OK if ok else FAILED, torch.version.cuda,
                 f"captured y = 2x + 1 in {capture * 1e3:.1f} ms (with warm-up); replay "
                 + ("matches eager" if ok else "differs from eager"))


def _guard(name: str, probe: Probe, work: Path, debug: bool) -> list[Check]:
    try:
        out = probe(work)
    except NeedsPackage as exc:
        return [Check(name, MISSING, "-", str(exc))]
    except Exception as exc:  # noqa: BLE001 - a broken backend must become a FAILED line
        if debug:
            traceback.print_exc()
        return [Check(name, FAILED, "-", f"{type(exc).__name__}: {exc}".splitlines()[0][:160])]
    return out if isinstance(out, list) else [out]


def probe_policy(work: Path) -> Check:
    """builtin:gru through the detected profile's engine preference: which engine runs, how fast."""
    import numpy as np

    import devices

    from ..policy import load_policy

    profile = devices.detect_profile("auto")
    runner = load_policy("builtin:gru", device="cuda" if profile.device == "cuda" else "cpu",
                         engines=profile.engines)
    obs = {"observation.state": np.zeros(14, dtype=np.float32)}
    for _ in range(20):   # warm-up
        runner.step(obs)
    t0 = time.perf_counter()
    for _ in range(200):
        runner.step(obs)
    step_us = (time.perf_counter() - t0) / 200 * 1e6
    skipped = "; ".join(f"{k}: {v}" for k, v in runner.skipped.items())
    return Check("policy", OK, runner.engine_name,
                 f"builtin:gru {step_us:.0f} us/step on {runner.engine_detail} (profile {profile.name})"
                 + (f"; skipped {skipped}"[:120] if skipped else ""))


def probe_llm_onnxruntime(work: Path) -> Check:
    """The LLM engine "onnxruntime" (runtime.llm_engines): a builtin:tiny prefill chunk through
    the ONNX step graph against the torch step, then one decode step's time."""
    import torch

    from ..llm import load_model
    from ..llm.engine_ort import OrtStep, missing_packages
    why = missing_packages()
    if why is not None:
        raise NeedsPackage(why)
    model, _ = load_model("builtin:tiny")
    model.prepare_rope(64)
    c = model.cfg
    pool = torch.randn(4, c.num_layers, 2, 16, c.num_kv_heads, c.head_dim,
                       generator=torch.Generator().manual_seed(0))
    ids, pos, table = torch.arange(1, 9)[None], torch.arange(8)[None], torch.tensor([[1, 2]])
    step = OrtStep(model, threads=1)
    with torch.no_grad():
        err = float((model(ids, pos, pos.view(-1) + 16, table, pool.clone())
                     - step(ids, pos, pos.view(-1) + 16, table, pool)).abs().max())
        one, at = ids[:, :1], torch.tensor([[8]])
        step(one, at, at.view(-1) + 16, table, pool)                    # warm-up (its session)
        t0 = time.perf_counter()
        for _ in range(20):
            step(one, at, at.view(-1) + 16, table, pool)
    ms = (time.perf_counter() - t0) / 20 * 1e3
    return Check("llm onnxruntime", OK if err < 1e-4 else FAILED, "CPUExecutionProvider",
                 f"builtin:tiny step max |diff| {err:.1e} vs torch, {ms:.2f} ms/decode step "
                 "(runtime.llm_engines)")


def probe_llm_tensorrt(work: Path) -> Check:
    """The LLM engine "tensorrt" (runtime.llm_engines): a builtin:tiny decode step through a
    TensorRT engine against the torch step on the GPU, then its time."""
    import torch

    from ..llm import load_model
    from ..llm.engine_trt import TrtStep, tensorrt_or_why
    cuda = torch.device("cuda")
    trt, why = tensorrt_or_why(cuda)
    if why is not None:
        return Check("llm tensorrt", MISSING, "-" if trt is None else trt.__version__, why)
    model, _ = load_model("builtin:tiny", device=cuda)
    model.prepare_rope(64)
    c = model.cfg
    pool = torch.randn(4, c.num_layers, 2, 16, c.num_kv_heads, c.head_dim, device=cuda,
                       generator=torch.Generator(cuda).manual_seed(0))
    one, at, table = torch.tensor([[3]], device=cuda), torch.tensor([[20]], device=cuda), torch.tensor([[1, 2]], device=cuda)
    step = TrtStep(model)
    with torch.no_grad():
        err = float((model(one, at, at.view(-1) + 16, table, pool.clone())
                     - step(one, at, at.view(-1) + 16, table, pool)).abs().max())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step(one, at, at.view(-1) + 16, table, pool)
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 20 * 1e3
    return Check("llm tensorrt", OK if err < 1e-4 else FAILED, trt.__version__,
                 f"builtin:tiny decode step max |diff| {err:.1e} vs torch, {ms:.2f} ms/step "
                 "(runtime.llm_engines)")


def default_probes() -> list[tuple[str, Probe]]:
    """torch itself (it runs the LLM) and the C decode, int4 and fp32 kernels, each registered policy engine's
    probe, the policy path, then the LLM engines besides torch."""
    engines = [(e.name, e.probe) for e in registry.ENTRIES if e.probe is not None]
    return [("torch cpu", probe_torch_cpu), ("decode kernel", probe_decode_kernel), ("int4 kernel", probe_int4_kernel),
            ("fp32 kernel", probe_f32_kernel), ("torch cuda", probe_torch_cuda), ("cuda graphs", probe_cuda_graphs),
            *engines, ("policy", probe_policy), ("llm onnxruntime", probe_llm_onnxruntime),
            ("llm tensorrt", probe_llm_tensorrt)]


def run_checks(probes: Sequence[tuple[str, Probe]] | None = None, *, debug: bool = False) -> list[Check]:
    """Run every probe in a scratch folder (deleted afterwards); a probe that raises becomes FAILED."""
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="capsule-doctor-") as tmp:
        for i, (name, probe) in enumerate(probes if probes is not None else default_probes()):
            work = Path(tmp) / str(i)
            work.mkdir()
            checks.extend(_guard(name, probe, work, debug))
    return checks


def format_checks(checks: Sequence[Check]) -> str:
    w_name = max(len(c.name) for c in checks)
    w_ver = max(len(c.version) for c in checks)
    return "\n".join(f"{c.name:<{w_name}}  {c.status:<7}  {c.version:<{w_ver}}  {c.reason}" for c in checks)


def cpu_works(checks: Sequence[Check]) -> bool:
    """The exit criterion: torch on the CPU runs a real decode step."""
    return any(c.name == "torch cpu" and c.status == OK for c in checks)
