"""runtime.llm_engines: a Session whose LLM steps run through ONNX Runtime (issue 15) gives the
torch engine's greedy text, keeps the pool in place across capsules and rollbacks, continues a
capsule bit-exactly in a fresh process, and binds the engine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import devices
from capsule import CapsuleMismatch, Session
from capsule.errors import EngineUnavailable
from capsule.llm import load_model
from capsule.llm.engines import select_llm_engine

ORT = {"kv_pool_mb": 16, "max_context": 1024, "threads": 1, "llm_engines": ["onnxruntime", "torch"]}
TORCH = {**ORT, "llm_engines": ["torch"]}
PROMPT = "".join(f"user: step {i}: move the red cup {i * 7} cm left, then report.\nrobot: ok.\n"
                 for i in range(12))

CHILD = r"""
import json, sys
from capsule import Session
a = json.loads(sys.argv[1])
with Session.open(a["store"], model="builtin:small", device="cpu", runtime=a["rt"]) as s:
    out = {"engine": s.llm_engine, "restored": s.restored_epoch,
           "reply": s.generate(a["m"], stream=a["streams"], temperature=0.8, top_p=0.95)}
    out["tokens"] = {n: s.tokens(n) for n in a["streams"]}
print(json.dumps(out))
"""


def _open(path, rt):
    return Session.open(path, model="builtin:small", device="cpu", runtime=rt)


def test_greedy_text_equals_the_torch_engine(tmp_path):
    texts = {}
    for name, rt in (("torch", TORCH), ("onnxruntime", ORT)):
        with _open(tmp_path / name, rt) as s:
            assert s.llm_engine == name
            s.append(PROMPT)
            s.append("second stream: where is the cup?", stream="b")
            texts[name] = (s.generate(40, stream=["main", "b"]), s.tokens("main"), s.tokens("b"))
    assert texts["onnxruntime"] == texts["torch"]


def test_capsule_under_ort_continues_in_a_fresh_process_and_rolls_back_in_place(tmp_path):
    store = tmp_path / "s"
    streams = ["main", "b"]
    with _open(store, ORT) as s:
        s.append(PROMPT)
        s.append("plan the next move", stream="b")
        s.generate(6, stream=streams, temperature=0.8, top_p=0.95, seed=7)
        epoch = s.checkpoint()
        ptrs = s.registry.data_ptrs()
        s.generate(10, stream=streams, temperature=0.8, top_p=0.95)
        want = {n: s.tokens(n) for n in streams}
        assert s.rollback(epoch) == epoch and s.registry.data_ptrs() == ptrs
        s.generate(10, stream=streams, temperature=0.8, top_p=0.95)
        assert {n: s.tokens(n) for n in streams} == want
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(
        {"store": str(store), "rt": ORT, "streams": streams, "m": 10})],
        capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert (got["engine"], got["restored"]) == ("onnxruntime", epoch)
    assert got["tokens"] == want


def test_a_capsule_is_bound_to_its_engine(tmp_path):
    with _open(tmp_path / "s", ORT) as s:
        s.append("hello")
        s.generate(2)
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="llm_engine=onnxruntime != session .*llm_engine=torch"):
        _open(tmp_path / "s", TORCH)


def test_engine_lists_are_checked_and_fall_back_in_order():
    prof = devices.load_profile("x86-cpu")
    with pytest.raises(ValueError, match=r"runtime.llm_engines\[0\]"):
        prof.replace_runtime(llm_engines=["tensorrt-llm"])
    with pytest.raises(ValueError, match="more than once"):
        prof.replace_runtime(llm_engines=["torch", "torch"])
    with pytest.raises(ValueError, match="non-empty"):
        prof.replace_runtime(llm_engines=[])
    model16, _ = load_model("builtin:tiny", dtype=__import__("torch").float16)
    with pytest.raises(EngineUnavailable, match="onnxruntime: .*runs fp32 models"):
        select_llm_engine(model16, ["onnxruntime"])
    assert select_llm_engine(model16, ["onnxruntime", "torch"]) is None      # the fallback
