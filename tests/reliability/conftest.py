"""Fixtures shared by the reliability campaign's tests."""
from __future__ import annotations

import shutil

import pytest

from capsule.tools.bench import reliability_harness as H


@pytest.fixture
def work(request):
    """A fresh folder on a tmpfs when there is one (fsync is free there; these trials do not depend
    on the disk's own durability), kept after a failure for a post-mortem."""
    path = H.work_dir(request.node.nodeid)
    failed = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed:
        shutil.rmtree(path, ignore_errors=True)
