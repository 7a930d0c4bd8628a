"""GPU-check step `env`: what this machine runs the check with.

Python, torch (and its CUDA build), the GPU, ONNX Runtime's version and providers, triton /
cupy / onnx / tensorrt when importable, and whether every dependency in pyproject.toml is
installed (a lent GPU machine has no network: a missing one must be carried as a wheel).
ok: the device asked for is usable and no dependency is missing.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import sys
from typing import Any

import torch

from ..bench.report import REPO_ROOT, machine_info

OPTIONAL = ("onnxruntime", "onnxruntime-gpu", "onnx", "triton", "cupy-cuda13x", "cupy-cuda12x", "tensorrt",
            "pytest", "hypothesis", "transformers")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def declared_dependencies() -> list[str] | None:
    """Distribution names in pyproject.toml's [project].dependencies (None: no checkout, or
    Python < 3.11, which has no tomllib)."""
    path = REPO_ROOT / "pyproject.toml"
    if sys.version_info < (3, 11) or not path.is_file():
        return None
    import tomllib

    deps = tomllib.loads(path.read_text(encoding="utf-8"))["project"]["dependencies"]
    return [re.match(r"[A-Za-z0-9._-]+", d).group(0) for d in deps]   # type: ignore[union-attr]


def _gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_available": False}
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {"cuda_available": True, "gpu": p.name, "gpu_count": torch.cuda.device_count(),
            "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
            "gpu_memory_gib": round(total / 2**30, 1), "gpu_free_gib": round(free / 2**30, 1)}


def _ort() -> dict[str, Any]:
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError as exc:
        return {"ort": None, "ort_providers": [], "ort_error": str(exc)}
    return {"ort": ort.__version__, "ort_providers": list(ort.get_available_providers())}


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    m = machine_info()
    deps = declared_dependencies()
    versions = {d: _version(d) for d in deps or ()}
    missing = [d for d, v in versions.items() if v is None]
    out: dict[str, Any] = {
        "python": m["python"], "executable": sys.executable, "platform": m["platform"], "cpu": m["cpu"],
        "cpu_cores": m["cpu_cores"], "torch": m["torch"], "torch_cuda_build": torch.version.cuda,
        "numpy": m["numpy"], "capsule": m["capsule"], "git_commit": m["git_commit"], **_gpu(), **_ort(),
        "optional": {d: _version(d) for d in OPTIONAL},
        "dependencies": versions if deps is not None else "not read (no pyproject.toml or Python < 3.11)",
        "missing_dependencies": missing}
    problems = []
    if device == "cuda" and not out["cuda_available"]:
        problems.append(f"--device cuda, but torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                        "sees no GPU: run with the image's python3, not a venv with a CPU torch")
    if missing:
        problems.append(f"missing packages {', '.join(missing)}: build the carry folder with `make "
                        "wheelhouse` and let packaging/gpu_check.sh install wheelhouse/*.whl")
    if problems:
        out["error"] = "; ".join(problems)
    out["ok"] = not problems
    return out
