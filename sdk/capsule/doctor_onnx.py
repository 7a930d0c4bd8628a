"""Doctor probes for the ONNX backends: ONNX Runtime (each provider) and TensorRT.

Both run the same tiny Linear exported from torch and compare with torch within 1e-5.
Exporting needs the `onnx` package; without it the probes say so instead of failing.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from .doctor import FAILED, MISSING, OK, Check, NeedsPackage, exact_probe_tensors

TOLERANCE = 1e-5
ONNX_EXTRA = "pip install 'exec-capsules[onnx]'"
# providers that onnxruntime lists but that run nothing on this machine (Azure calls a cloud
# endpoint): not backends of a robot, so the doctor leaves them out
NOT_LOCAL_PROVIDERS = frozenset({"AzureExecutionProvider"})


def export_probe(work: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """Export the probe Linear to work/probe.onnx; return (path, input array, torch output array)."""
    import torch

    try:
        import onnx  # noqa: F401  - torch.onnx.export serializes through it
    except ImportError:
        raise NeedsPackage(f"the `onnx` package (needed to export the probe model) is not installed: "
                           f"{ONNX_EXTRA}") from None
    linear, x = exact_probe_tensors()
    path = work / "probe.onnx"
    if not path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation chatter is not the user's concern
            try:  # the TorchScript exporter needs only `onnx`; the dynamo one also needs onnxscript
                torch.onnx.export(linear, (x,), str(path), input_names=["x"], output_names=["y"],
                                  opset_version=17, dynamo=False)
            except TypeError:
                torch.onnx.export(linear, (x,), str(path), input_names=["x"], output_names=["y"])
    with torch.no_grad():
        want = linear(x)
    return path, x.numpy(), want.numpy()


def _max_diff(got: Any, want: np.ndarray) -> float:
    import numpy as np

    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max())


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
    diff = _max_diff(got, want)
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


def _trt_run(trt: Any, path: Path, x: np.ndarray, want: np.ndarray) -> np.ndarray:
    import torch

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    # TensorRT 10 networks are always explicit-batch; 8.x needs the flag
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"ONNX parser: {errors}")
    blob = builder.build_serialized_network(network, builder.create_builder_config())
    if blob is None:
        raise RuntimeError("engine build returned nothing (set the logger to VERBOSE to see why)")
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    context = engine.create_execution_context()
    xin = torch.from_numpy(x).cuda()
    out = torch.empty(tuple(want.shape), dtype=torch.float32, device="cuda")
    context.set_tensor_address("x", xin.data_ptr())
    context.set_tensor_address("y", out.data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("execute_async_v3 returned False")
    stream.synchronize()
    return out.cpu().numpy()


def probe_tensorrt(work: Path) -> Check:
    try:
        import tensorrt as trt
    except ImportError as exc:
        return Check("tensorrt", MISSING, "-", f"not importable ({exc}); pip install 'exec-capsules[tensorrt]' "
                     "or use JetPack's python3-libnvinfer")
    import torch

    if not torch.cuda.is_available():
        return Check("tensorrt", MISSING, trt.__version__, "needs a CUDA GPU; torch.cuda.is_available() is False")
    try:
        path, x, want = export_probe(work)
    except NeedsPackage as exc:
        return Check("tensorrt", MISSING, trt.__version__, f"importable, but {exc}")
    diff = _max_diff(_trt_run(trt, path, x, want), want)
    if diff > TOLERANCE:
        return Check("tensorrt", FAILED, trt.__version__, f"engine output differs from torch by {diff:.1e}")
    return Check("tensorrt", OK, trt.__version__, f"built an engine for the probe Linear; matches torch "
                 f"(max diff {diff:.1e})")


def probe_policy(work: Path) -> Check:
    """builtin:gru through the detected profile's engine preference: which engine runs, how fast."""
    import numpy as np

    import devices
    from .policy import load_policy

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
