"""runtime.threads: torch's intra-op threads at Session.open, onnxruntime's per policy session,
the binding (a capsule continues bit-exactly only at its thread count), and the doctor's load line."""
from __future__ import annotations

import os

import pytest
import torch

from capsule import CapsuleMismatch, Session
from capsule.policy import load_policy
from capsule.tools import doctor

RT = {"kv_pool_mb": 4, "max_context": 512}


@pytest.fixture
def torch_threads():
    """torch's count is process-wide: give every test back the count it found."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_threads_sets_torch_intra_op_threads(tmp_path, torch_threads):
    torch.set_num_threads(2)
    with Session.open(tmp_path / "s", model="builtin:tiny", device="cpu", runtime={**RT, "threads": 1}) as s:
        assert torch.get_num_threads() == 1
        s.append("user: hello\nrobot:")
        s.generate(3)
    assert torch.get_num_threads() == 1          # process-wide: it outlives the session
    torch.set_num_threads(2)
    with Session.open(tmp_path / "t", model="builtin:tiny", device="cpu", runtime=RT):
        assert torch.get_num_threads() == 2      # unset: torch's count is left alone


def test_a_capsule_is_bound_to_its_thread_count(tmp_path, torch_threads):
    with Session.open(tmp_path / "s", model="builtin:tiny", device="cpu", runtime={**RT, "threads": 2}) as s:
        s.append("user: hello\nrobot:")
        epoch = s.checkpoint()
    with pytest.raises(CapsuleMismatch, match=r"threads=2 != session threads=1"):
        Session.open(tmp_path / "s", model="builtin:tiny", device="cpu", runtime={**RT, "threads": 1})
    with Session.open(tmp_path / "s", model="builtin:tiny", device="cpu", runtime={**RT, "threads": 2}) as s:
        assert s.restored_epoch == epoch


@pytest.mark.parametrize("threads,want", [(None, 1), (1, 1), (3, 3)])
def test_onnxruntime_session_gets_the_threads(threads, want):
    runner = load_policy("builtin:gru", device="cpu", engines=("onnxruntime",), threads=threads)
    assert runner.engine_name == "onnxruntime"
    assert runner.engine.threads == want                  # read back from the InferenceSession


def test_session_policy_gets_runtime_threads(tmp_path, torch_threads):
    with Session.open(tmp_path / "s", model=None, policy="builtin:mlp", device="cpu",
                      runtime={"threads": 2}) as s:
        assert s.policy_engine == "onnxruntime" and s.actor.runner.engine.threads == 2


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_threads_are_refused(bad):
    with pytest.raises(ValueError, match="threads"):
        load_policy("builtin:mlp", device="cpu", engines=("torch",), threads=bad)


def test_torch_engine_leaves_threads_to_the_session():
    runner = load_policy("builtin:mlp", device="cpu", engines=("torch",), threads=2)
    assert runner.engine_name == "torch"                  # built without a threads argument


def test_doctor_warns_when_the_load_leaves_no_core_for_the_session(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 1.0, 1.0))
    busy = doctor.cpu_load_check(threads=2)               # 2 cores free, load 3.5
    assert busy.status == doctor.WARN and 'runtime={"threads": 1}' in busy.reason
    assert "3.50" in busy.reason and "2 free" in busy.reason
    assert doctor.cpu_load_check(threads=1).status == doctor.WARN      # 3 free < 3.5
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    idle = doctor.cpu_load_check(threads=2)
    assert idle.status == doctor.OK and "runtime=" not in idle.reason


def test_doctor_load_line_counts_torch_threads_when_unset(monkeypatch, torch_threads):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    torch.set_num_threads(2)
    assert doctor.cpu_load_check().status == doctor.OK                 # 2 free >= 1.5
    torch.set_num_threads(3)
    assert doctor.cpu_load_check().status == doctor.WARN               # 1 free < 1.5


def test_doctor_without_a_load_average(monkeypatch):
    def missing():
        raise OSError("no load average")
    monkeypatch.setattr(os, "getloadavg", missing)
    assert doctor.cpu_load_check(threads=1).status == doctor.OK
