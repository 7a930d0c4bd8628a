"""onnxruntime engine: an InferenceSession whose IOBinding points at the static buffers.

Inputs are bound to buffers.obs[*] and buffers.hidden (as `hidden_in`), outputs to
buffers.action and to a second static buffer for `hidden_out`, which is copied into
buffers.hidden after the run (the model never reads and writes the same memory in one run,
and buffers.hidden never moves, so a restore lands where the binding points). The binding is
made once; a step is one run_with_iobinding plus that copy_, and allocates nothing after
warm-up. Providers: TensorRT/CUDA execution providers when the device is CUDA and ORT offers
them (computing on the policy's own stream, PolicyBuffers.stream, and fp32 without TF32), else
CPU (one intra-op thread unless runtime.threads says otherwise: these policies are far too
small to gain from more; `threads` reports what the InferenceSession runs with).
Not thread-safe: the runner serializes calls. probe_onnxruntime is this engine's doctor probe.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import EngineUnavailable
from ..paths import cache_dir
from .buffers import PolicyBuffers
from .probe import FAILED, MISSING, OK, ONNX_EXTRA, TOLERANCE, Check, NeedsPackage, export_probe, max_diff
from .source import PolicySource
from .spec import ACTION, HIDDEN_IN, HIDDEN_OUT

CPU_EP, CUDA_EP, TRT_EP = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
ORT_EXTRA = ("pip install 'exec-capsules[onnx]' (CPU) or 'exec-capsules[cuda]' (CUDA: onnxruntime-gpu, "
             "which breaks when the CPU onnxruntime is installed beside it: uninstall that first)")
# providers that onnxruntime lists but that run nothing on this machine (Azure calls a cloud
# endpoint): not backends of a robot, so the doctor leaves them out
NOT_LOCAL_PROVIDERS = frozenset({"AzureExecutionProvider"})


def choose_providers(ort: Any, device: torch.device, stream: torch.cuda.Stream | None = None) -> list[Any]:
    """Execution providers for `device` from what this onnxruntime build offers; on CUDA they
    compute on `stream` (the policy's own, PolicyBuffers.stream) when one is given."""
    offered = ort.get_available_providers()
    if device.type == "cpu":
        return [CPU_EP]
    if device.type != "cuda":
        raise EngineUnavailable(f"device type {device.type!r} is not supported (cpu, cuda)")
    idx = device.index or 0
    # ORT's user_compute_stream: its kernels join the stream the obs copies were queued on
    on: dict[str, Any] = {} if stream is None else {"user_compute_stream": str(stream.cuda_stream)}
    chosen: list[Any] = []
    if TRT_EP in offered:
        engines = cache_dir() / "policy" / "ort-trt"
        engines.mkdir(parents=True, exist_ok=True)
        chosen.append((TRT_EP, {"device_id": idx, "trt_engine_cache_enable": True,
                                "trt_engine_cache_path": str(engines), **on}))
    if CUDA_EP in offered:
        # ORT's CUDA provider computes fp32 MatMul/Gemm/Conv in TF32 by default (10-bit mantissa,
        # microsoft/onnxruntime#19357): fp32 means fp32, so the 1e-4 parity with torch holds
        chosen.append((CUDA_EP, {"device_id": idx, "use_tf32": 0, **on}))
    if not chosen:
        raise EngineUnavailable(f"onnxruntime offers {offered}: no CUDA provider for {device} ({ORT_EXTRA})")
    return chosen + [CPU_EP]  # CPU takes the shape-only nodes the GPU providers leave


class OrtEngine:
    name = "onnxruntime"

    def __init__(self, source: PolicySource, buffers: PolicyBuffers, *, threads: int | None = None):
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EngineUnavailable(f"onnxruntime is not importable ({exc}); {ORT_EXTRA}") from None
        dev = buffers.device
        self.buffers = buffers
        self.cuda = dev.type == "cuda"
        providers = choose_providers(ort, dev, buffers.stream)
        path = source.onnx_path()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1 if threads is None else threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception:
            if not providers or providers[0][0] != TRT_EP:
                raise
            # the TensorRT provider could not build (libs missing, unsupported op): without it
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers[1:])
        used = self.session.get_providers()
        if self.cuda and used[0] == CPU_EP:
            raise EngineUnavailable(f"onnxruntime fell back to {CPU_EP} for a CUDA device (offered: {used})")
        self.detail = used[0]
        # on the policy's stream, the obs copies queued there come first by stream order; a
        # provider that did not take the stream runs on its own, so each run waits for them
        self.sync_before_run = self.cuda and not runs_on(self.session, used[0], buffers.stream)
        # what the session itself reports, not what was asked: ORT copies the options it is given
        self.threads: int = self.session.get_session_options().intra_op_num_threads
        # hidden_out lands here, then copy_ into buffers.hidden: a static twin, never registered
        self.hidden_next = torch.empty_like(buffers.hidden) if buffers.hidden is not None else None
        self.binding = self.session.io_binding()
        for key, t in buffers.obs.items():
            self._bind(self.binding.bind_input, key, t)
        if buffers.hidden is not None:
            self._bind(self.binding.bind_input, HIDDEN_IN, buffers.hidden)
            self._bind(self.binding.bind_output, HIDDEN_OUT, self.hidden_next)
        self._bind(self.binding.bind_output, ACTION, buffers.action)
        with buffers.on_stream():   # as a step runs it (the hidden copy is torch's)
            for _ in range(2):  # warm-up: ORT sizes its arena and plans memory on the first runs
                self.run()

    def _bind(self, bind: Any, name: str, t: torch.Tensor) -> None:
        dtype = np.dtype(str(t.dtype).removeprefix("torch."))
        bind(name, t.device.type, t.device.index or 0, dtype, list(t.shape), t.data_ptr())

    def run(self) -> None:
        # hot path: no allocation, and no wait on any stream but the policy's (the runner makes
        # it current on CUDA); ORT synchronizes the stream it computes on before run returns
        if self.sync_before_run:
            self.buffers.stream.synchronize()
        self.session.run_with_iobinding(self.binding)
        if self.hidden_next is not None:
            self.buffers.hidden.copy_(self.hidden_next)  # in place: (1, H) <- (1, H)


def runs_on(session: Any, provider: str, stream: torch.cuda.Stream | None) -> bool:
    """Whether `session`'s `provider` took `stream` as its compute stream (what ORT reports)."""
    if stream is None:
        return False
    taken = session.get_provider_options().get(provider, {}).get("user_compute_stream")
    return taken == str(stream.cuda_stream)


# -- doctor probe: the probe Linear through each local execution provider ---------------------

def _run_provider(ort: Any, provider: str, path: Path, x: np.ndarray, want: np.ndarray) -> Check:
    name = f"onnxruntime {provider.removesuffix('ExecutionProvider')}"
    try:
        sess = ort.InferenceSession(str(path), providers=[provider])
        used = sess.get_providers()
        if not used or used[0] != provider:  # ORT may quietly fall back to the CPU provider
            return Check(name, FAILED, ort.__version__, f"session fell back to {used[:1]}")
        (got,) = sess.run(["y"], {"x": x})
    except Exception as exc:  # noqa: BLE001 - one broken provider must not hide the others
        return Check(name, FAILED, ort.__version__, f"{type(exc).__name__}: {exc}".splitlines()[0][:160])
    diff = max_diff(got, want)
    if diff > TOLERANCE:
        return Check(name, FAILED, ort.__version__, f"output differs from torch by {diff:.1e}")
    return Check(name, OK, ort.__version__, f"probe Linear(16->8) matches torch (max diff {diff:.1e})")


def probe_onnxruntime(work: Path) -> list[Check]:
    """One line per available local execution provider (CPU, CUDA, TensorRT, ...)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return [Check("onnxruntime", MISSING, "-", f"not importable ({exc}); {ONNX_EXTRA}")]
    try:
        path, x, want = export_probe(work)
    except NeedsPackage as exc:
        return [Check("onnxruntime", MISSING, ort.__version__, f"importable, but {exc}")]
    return [_run_provider(ort, p, path, x, want) for p in ort.get_available_providers()
            if p not in NOT_LOCAL_PROVIDERS]
