"""What a GPU install gets (issue 14, items 4 and 12): the extras, read from pyproject.toml, and
the `ort_cuda` skip of `pytest -m cuda` on a GPU machine whose onnxruntime is the CPU package."""
from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement


def _load_conftest() -> types.ModuleType:
    # by path: in a whole-suite run the module name "conftest" may be tests/reliability's
    import importlib.util
    spec = importlib.util.spec_from_file_location("capsule_tests_conftest", Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


conftest = _load_conftest()
tomllib = pytest.importorskip("tomllib")   # Python 3.11+
REPO = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return {name: {r.name: r for r in map(Requirement, reqs)} for name, reqs in extras.items()}


def test_gpu_extras_never_pull_cpu_onnxruntime():
    extras = _extras()
    for gpu in ("cuda", "jetson"):
        assert "onnxruntime" not in extras[gpu] and "onnxruntime-gpu" in extras[gpu], gpu
        # the CUDA provider's use_tf32 option (engine_ort.choose_providers) came with 1.18
        assert not extras[gpu]["onnxruntime-gpu"].specifier.contains("1.17.3"), gpu
    assert "onnxruntime-gpu" not in extras["onnx"]
    # the test extra combines with either: it names neither package
    assert not {"onnxruntime", "onnxruntime-gpu"} & set(extras["test"])
    assert '.[test,onnx]' in (REPO / "Makefile").read_text()      # CI (CPU) takes the CPU package


def test_tensorrt_extra_admits_every_tensorrt_the_engine_supports():
    spec = _extras()["tensorrt"]["tensorrt"].specifier
    for version in ("8.5.2", "8.6.2", "10.3.0", "10.13.0"):   # JetPack 5.1, 6.0, 6.1; desktop
        assert spec.contains(version), version
    # execute_async_v3 and the name-based tensor API arrived in 8.5; the 8.x explicit-batch path exists
    source = (REPO / "sdk" / "capsule" / "policy" / "engine_trt.py").read_text()
    assert "execute_async_v3" in source and "EXPLICIT_BATCH" in source and not spec.contains("8.4.3")


def test_no_extra_declares_a_package_nothing_imports():
    extras = _extras()
    assert not any("pycuda" in reqs for reqs in extras.values())
    imported = set()
    for path in (REPO / "sdk").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    modules = {"onnx": "onnx", "onnxruntime": "onnxruntime", "onnxruntime-gpu": "onnxruntime",
               "tensorrt": "tensorrt"}            # distribution -> the module the SDK imports
    for extra in ("onnx", "cuda", "jetson", "tensorrt"):
        for name in extras[extra]:
            assert modules.get(name) in imported, f"extra {extra!r} declares {name}, which sdk/ never imports"


class _Item:
    def __init__(self, *keywords: str):
        self.keywords = dict.fromkeys(keywords)
        self.skips: list[str] = []

    def add_marker(self, mark) -> None:
        self.skips.append(mark.kwargs["reason"])


def _fake_ort(monkeypatch, providers: list[str]) -> None:
    fake = types.SimpleNamespace(__version__="9.9.9", get_available_providers=lambda: providers)
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)


def test_pytest_m_cuda_skips_the_ort_cases_without_a_cuda_provider(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # a GPU machine
    _fake_ort(monkeypatch, ["AzureExecutionProvider", "CPUExecutionProvider"])   # CPU onnxruntime
    torch_case, ort_case = _Item("cuda"), _Item("cuda", "ort_cuda")
    conftest.pytest_collection_modifyitems(None, [torch_case, ort_case])
    assert torch_case.skips == []
    assert len(ort_case.skips) == 1 and "no CUDAExecutionProvider" in ort_case.skips[0]
    assert "onnxruntime-gpu" in ort_case.skips[0] and "CPUExecutionProvider" in ort_case.skips[0]
    _fake_ort(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])   # onnxruntime-gpu
    ort_case = _Item("cuda", "ort_cuda")
    conftest.pytest_collection_modifyitems(None, [ort_case])
    assert ort_case.skips == []
    monkeypatch.setitem(sys.modules, "onnxruntime", None)             # none installed
    assert "not importable" in conftest.ort_cuda_missing()
