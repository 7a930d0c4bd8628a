"""Capsules on CUDA: graph replay after an in-place restore equals an uninterrupted run."""
from __future__ import annotations

import pytest
import torch

from capsule import Session

pytestmark = pytest.mark.cuda
RT = {"kv_pool_mb": 64, "max_context": 2048, "dtype": "float32", "cuda_graphs": True}


def test_graph_replay_after_in_place_restore_equals_uninterrupted(tmp_path):
    with Session.open(tmp_path / "s", device="cuda", runtime=RT) as s:
        runner = s.engine.runner
        assert runner.uses_graphs
        s.append("user: bring me the red cup\n" * 20)
        s.append("hi", stream="b")
        s.generate(4, stream=["main", "b"])
        epoch = s.checkpoint()
        ptrs = s.registry.data_ptrs()
        want = s.generate(16, stream=["main", "b"], temperature=0.7, seed=3)
        s.rollback(epoch)
        assert s.registry.data_ptrs() == ptrs          # same storage: the captured graphs stay valid
        assert s.generate(16, stream=["main", "b"], temperature=0.7, seed=3) == want


def test_async_checkpoint_stages_through_pinned_memory(tmp_path):
    with Session.open(tmp_path / "s", device="cuda", runtime=RT) as s:
        s.append("robot state " * 100)
        for _ in range(10):
            s.generate(2)
            s.checkpoint(wait=False)
        s.flush()
        want = s.tokens()
        torch.cuda.synchronize()
    with Session.open(tmp_path / "s", device="cuda", runtime=RT) as s:
        assert s.restored_epoch == 10 and s.tokens() == want
