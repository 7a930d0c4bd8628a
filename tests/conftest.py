"""Shared fixtures. Builtin presets are materialized into a per-run cache folder."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# keep the user's cache untouched and runs independent; one folder per test run, removed at its end
# (a run leaves nothing in the temp folder; subprocesses the tests start inherit the variable)
if "CAPSULE_CACHE_DIR" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="capsule-test-cache-")
    os.environ["CAPSULE_CACHE_DIR"] = _RUN_CACHE
else:
    _RUN_CACHE = None


def pytest_sessionfinish(session, exitstatus):
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
