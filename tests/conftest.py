"""Shared fixtures. Builtin presets are materialized into a per-run cache folder.

A run leaves nothing in the temp folder but pytest's own tmp_path root (pytest-of-<user>):
everything the tests, the SDK and the libraries under them write there (tempfile, TMPDIR;
subprocesses inherit it) goes into one private folder per run, capsule-test-run-*, removed at
the end. Before that, the run fails when the tests or the SDK left anything of their own in it
(capsule-*, tmp*: what they create and must remove).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# before torch and the libraries read them: the run's temp folder, its caches inside it
if "CAPSULE_TEST_RUN_TMP" not in os.environ:   # a subprocess running pytest again shares the parent's
    # pytest's own tmp_path root (pytest-of-<user>, kept after a failure for a post-mortem)
    # stays in the temp folder, where it was: deeper paths would break AF_UNIX socket tests
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _RUN_TMP = tempfile.mkdtemp(prefix="capsule-test-run-")
    os.environ["CAPSULE_TEST_RUN_TMP"] = os.environ["TMPDIR"] = _RUN_TMP
    tempfile.tempdir = _RUN_TMP
else:
    _RUN_TMP = None
# keep the user's cache untouched and runs independent (one folder per test run)
_CACHES = {"CAPSULE_CACHE_DIR": "capsule-cache", "TIKTOKEN_CACHE_DIR": "tiktoken-cache",
           "TORCHINDUCTOR_CACHE_DIR": "torchinductor-cache"}
for _var, _name in _CACHES.items():
    if _RUN_TMP is not None and _var not in os.environ:
        os.environ[_var] = os.path.join(_RUN_TMP, "caches", _name)

import torch  # noqa: E402

# Triton's CPU interpreter must be chosen before triton is first imported: torch's ONNX export
# imports it through dynamo, and triton.language builds its own jitted helpers then, which the
# interpreter cannot call later ("Cannot call @triton.jit'd outside of the scope of a kernel").
# Without a CUDA device the interpreter is the only way triton runs, so the session picks it now.
if "TRITON_INTERPRET" not in os.environ:
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# what the tests and the SDK name their temporary files and folders (the caches above, and
# what libraries write there, such as onnxruntime's .ses, are the run's, not leaks)
OWN_PREFIXES = ("capsule-", "tmp")


def leftovers(folder: Path) -> list[str]:
    """Names in `folder` that a test or the SDK made and did not remove."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(OWN_PREFIXES))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _RUN_TMP is None:
        return
    left = leftovers(Path(_RUN_TMP))
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nconftest: the tests left these in the temp folder (must remove them): {left}")
    shutil.rmtree(_RUN_TMP, ignore_errors=True)


# one thread per pytest-xdist worker (the workers already fill the cores), else up to two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


def ort_cuda_missing() -> str | None:
    """Why onnxruntime cannot run on CUDA here (None when its CUDAExecutionProvider is offered)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return f"onnxruntime is not importable ({exc}); install onnxruntime-gpu: pip install -e '.[test,cuda]'"
    offered = ort.get_available_providers()
    if "CUDAExecutionProvider" in offered:
        return None
    return (f"onnxruntime {ort.__version__} offers {offered}, no CUDAExecutionProvider: that is the CPU "
            "package; a GPU machine installs onnxruntime-gpu instead (pip install -e '.[test,cuda]')")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none here")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
        return
    ort_items = [item for item in items if "ort_cuda" in item.keywords]
    why = ort_cuda_missing() if ort_items else None
    for item in ort_items if why else ():
        item.add_marker(pytest.mark.skip(reason=why))
