"""Shared fixtures. Builtin presets are materialized into a per-run cache folder."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

# keep the user's cache untouched and runs independent; one folder per test run
os.environ.setdefault("CAPSULE_CACHE_DIR", tempfile.mkdtemp(prefix="capsule-test-cache-"))
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
