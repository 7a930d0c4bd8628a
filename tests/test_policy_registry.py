"""policy/registry.py: one table of policy engines that load_policy, the doctor and the bench read."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capsule.errors import ModelLoadError
from capsule.policy import EngineUnavailable, load_policy, registry
from capsule.policy.probe import OK, Check
from capsule.tools.doctor import default_probes, run_checks

REPO = Path(__file__).resolve().parents[1]
OBS = {"observation.state": np.zeros(14, dtype=np.float32)}


def test_the_registered_engines_in_preference_order():
    assert registry.engine_names() == ("tensorrt", "onnxruntime", "torch")
    assert len(set(registry.engine_names())) == len(registry.ENTRIES)
    assert all(e.summary and callable(e.build) for e in registry.ENTRIES)


def test_listing_the_registry_imports_no_engine_and_no_backend():
    code = ("import sys, capsule.policy.registry as r\n"
            "r.engine_names(); r.select_engines(['torch'])\n"
            "print(sorted(m for m in sys.modules if m.startswith(('capsule.policy.engine_', 'onnxruntime', "
            "'tensorrt'))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "sdk")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_each_engine_that_loads_here_runs_under_its_registered_name():
    for name in registry.engine_names():
        try:
            runner = load_policy("builtin:mlp", device="cpu", engines=(name,))
        except ModelLoadError as exc:   # tensorrt without CUDA: the reason names the engine
            assert f"{name}: " in str(exc)
            continue
        assert runner.engine_name == name
        assert runner.step(OBS).shape == runner.spec.action_shape


def test_select_engines_keeps_the_callers_order_and_names_the_registered_ones():
    assert [e.name for e in registry.select_engines(["torch", "tensorrt"])] == ["torch", "tensorrt"]
    for bad in ([], ["tflite"], ["torch", "tflite"]):
        with pytest.raises(ValueError) as err:
            registry.select_engines(bad)
        assert str(err.value) == f"engines must be a non-empty sequence of tensorrt, onnxruntime, torch; got {bad}"


def test_a_profile_naming_an_unregistered_or_misplaced_engine_is_refused_at_open(tmp_path):
    import yaml

    import devices
    from capsule import Session
    cpu = devices.load_profile("x86-cpu").to_dict()
    for engines, what in ((["onnxruntime", "tvm"], "engines[1]: 'tvm' is not a policy engine (registered: "
                                                   "tensorrt, onnxruntime, torch)"),
                          (["tensorrt", "torch"], "includes 'tensorrt', which needs device 'cuda'")):
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump(dict(cpu, name="p", engines=engines)), encoding="utf-8")
        with pytest.raises(ValueError, match="profile p") as err:
            Session.open(tmp_path / "s", model=None, policy="builtin:mlp", device=str(path))
        assert what in str(err.value)
        assert not (tmp_path / "s").exists()           # refused before anything is created
    registry.check_profile_engines(("tensorrt", "torch"), "cuda", "p")   # CUDA: fine


class _Fake:
    """An engine that copies nothing and leaves the action at zeros: enough to be selected."""

    name, detail = "fake", "test double"

    def __init__(self, source, buffers):
        self.buffers = buffers

    def run(self) -> None:
        self.buffers.action.zero_()


def _unavailable(source, buffers):
    raise EngineUnavailable("no fake hardware here")


def _with(monkeypatch, *extra: registry.EngineEntry) -> None:
    monkeypatch.setattr(registry, "ENTRIES", registry.ENTRIES + extra)


def test_a_new_engine_is_one_registry_entry(monkeypatch):
    probe = lambda work: Check("fake", OK, "1.0", "ran a tiny inference")  # noqa: E731
    _with(monkeypatch, registry.EngineEntry("fake", "a test double", _Fake, probe))
    runner = load_policy("builtin:gru", device="cpu", engines=("fake", "torch"))
    assert (runner.engine_name, runner.engine_detail) == ("fake", "test double")
    assert not runner.step(OBS).any()
    probes = default_probes()
    # the policy engines' probes come before the policy path, the LLM engines' after it
    assert ("fake", probe) in probes and [n for n, _ in probes][-3:] == ["policy", "llm onnxruntime", "llm tensorrt"]
    assert run_checks([p for p in probes if p[0] == "fake"]) == [Check("fake", OK, "1.0", "ran a tiny inference")]


def test_an_unavailable_engine_falls_back_in_order_and_says_why(monkeypatch):
    _with(monkeypatch, registry.EngineEntry("fake", "never available", _unavailable, None))
    runner = load_policy("builtin:mlp", device="cpu", engines=("fake", "torch"))
    assert runner.engine_name == "torch" and runner.skipped == {"fake": "no fake hardware here"}
    with pytest.raises(ModelLoadError, match=r"no policy engine can run .*: fake: no fake hardware here$"):
        load_policy("builtin:mlp", device="cpu", engines=("fake",))


def test_a_broken_engine_becomes_a_skip_reason(monkeypatch):
    def broken(source, buffers):
        raise RuntimeError("driver exploded\nsecond line")

    _with(monkeypatch, registry.EngineEntry("fake", "broken", broken, None))
    runner = load_policy("builtin:mlp", device="cpu", engines=("fake", "torch"))
    assert runner.skipped == {"fake": "RuntimeError: driver exploded"}


def test_the_doctor_runs_every_registered_probe():
    names = [n for n, _ in default_probes()]
    with_probe = [e.name for e in registry.ENTRIES if e.probe is not None]
    assert names == ["torch cpu", "decode kernel", "int4 kernel", "fp32 kernel", "torch cuda", "cuda graphs", *with_probe, "policy",
                     "llm onnxruntime", "llm tensorrt"]
    assert with_probe == ["tensorrt", "onnxruntime"]   # torch: doctor's own torch probes


def test_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        registry.ENTRIES[0].name = "other"  # type: ignore[misc]
