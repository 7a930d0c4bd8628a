"""The Session is a facade over composed parts (issue 12): no mixins, read-only views."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from capsule import Session

SDK = Path(__file__).resolve().parents[1] / "sdk" / "capsule"
VIEWS = ("engine", "memory", "actor", "store", "checkpointer", "tokenizer", "model_info", "closed",
         "restored_epoch", "restore_report", "policy_engine")


def test_no_class_of_the_session_room_inherits_from_another():
    for path in [SDK / "session.py", SDK / "assembly.py", *SDK.glob("session_*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                assert not node.bases, f"{path.name}: class {node.name} has bases (compose parts instead)"


@pytest.mark.parametrize("name", VIEWS)
def test_views_are_read_only(tmp_path, name):
    prop = getattr(Session, name)
    assert isinstance(prop, property) and prop.fset is None, name


def test_views_name_what_is_missing_and_refuse_a_closed_session(tmp_path):
    with Session.open(tmp_path / "llm", model="builtin:tiny", device="cpu") as s:
        assert s.engine.runner.buckets and s.memory.count() == 0 and s.store.epochs() == []
        assert s.checkpointer.snap is not None and s.tokenizer is not None and not s.closed
        with pytest.raises(ValueError, match="no policy"):
            s.actor
    assert s.closed
    for name in ("engine", "memory", "actor"):
        with pytest.raises(ValueError, match="closed"):
            getattr(s, name)
    with Session.open(tmp_path / "arm", model=None, policy="builtin:gru", device="cpu") as s:
        assert s.policy_engine == s.actor.runner.engine_name and s.tokenizer is None
        for name in ("engine", "memory"):
            with pytest.raises(ValueError, match="no model"):
                getattr(s, name)
