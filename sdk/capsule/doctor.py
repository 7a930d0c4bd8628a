"""`capsule doctor`: which backends really work here, each shown by running a tiny real inference.

Every probe imports its backend lazily and runs inside a guard, so a broken or missing
backend becomes one FAILED or MISSING line, never a crash of the command.
"""
from __future__ import annotations

import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch

OK, MISSING, FAILED = "OK", "MISSING", "FAILED"


@dataclass(frozen=True)
class Check:
    """One line of the report: status is OK, MISSING (not installed / no hardware) or FAILED."""

    name: str
    status: str
    version: str
    reason: str


class NeedsPackage(Exception):
    """A probe cannot run because a helper package (not the backend itself) is missing."""


Probe = Callable[[Path], "Check | list[Check]"]


def exact_probe_tensors() -> tuple[torch.nn.Linear, torch.Tensor]:
    """Linear(16 -> 8) weights and input made of multiples of 1/4.

    Their products and sums are exact in fp32, TF32 and fp16 alike, so any correct backend
    matches torch to well within 1e-5 whatever math mode it picks.
    """
    import torch

    gen = torch.Generator().manual_seed(0)

    def q(*shape: int) -> torch.Tensor:
        return torch.randint(-4, 5, shape, generator=gen).float() / 4

    linear = torch.nn.Linear(16, 8)
    with torch.no_grad():
        linear.weight.copy_(q(8, 16))
        linear.bias.copy_(q(8))
    return linear, q(2, 16)


def _matmul_error(device: str) -> float:
    import torch

    linear, x = exact_probe_tensors()
    with torch.no_grad():
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        got = linear.to(device)(x.to(device)).double().cpu()
    return float((got - want).abs().max())


def _session_tokens(work: Path, device: str, n: int = 8) -> tuple[float, str]:
    """Open builtin:tiny on `device` and time n greedy tokens (n - 1 decode steps); s/token and mode."""
    from .session import Session

    with Session.open(work / f"session-{device}", model="builtin:tiny", device=device,
                      runtime={"kv_pool_mb": 16}) as s:
        s.append("doctor: ping\n")
        s.generate(1)                     # prefill first, so the timing below is decode steps
        t0 = time.perf_counter()
        s.generate(n)
        per_token = (time.perf_counter() - t0) / n
        return per_token, "graphs on" if s._engine.runner.uses_graphs else "eager"


def probe_torch_cpu(work: Path) -> Check:
    import torch

    err = _matmul_error("cpu")
    if err > 1e-5:
        return Check("torch cpu", FAILED, torch.__version__, f"matmul off by {err:.2e}")
    step, mode = _session_tokens(work, "cpu")
    return Check("torch cpu", OK, torch.__version__,
                 f"matmul exact; builtin:tiny via Session {step * 1e3:.1f} ms/token ({mode}, "
                 f"{torch.get_num_threads()} threads)")


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
    x = torch.zeros(64, device="cuda")
    y = torch.zeros(64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as capture forbids lazy init
        y.copy_(x * 2 + 1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        y.copy_(x * 2 + 1)
    torch.cuda.synchronize()
    capture = time.perf_counter() - t0
    x.copy_(torch.arange(64, dtype=torch.float32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(y.cpu(), torch.arange(64, dtype=torch.float32) * 2 + 1)
    return Check("cuda graphs", OK if ok else FAILED, torch.version.cuda,
                 f"captured y = 2x + 1 in {capture * 1e3:.1f} ms; replay "
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


def default_probes() -> list[tuple[str, Probe]]:
    from .doctor_onnx import probe_onnxruntime, probe_policy, probe_tensorrt

    return [("torch cpu", probe_torch_cpu), ("torch cuda", probe_torch_cuda), ("cuda graphs", probe_cuda_graphs),
            ("onnxruntime", probe_onnxruntime), ("tensorrt", probe_tensorrt), ("policy", probe_policy)]


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
