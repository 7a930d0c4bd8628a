"""The GPU check (packaging/gpu_check.py): the whole check on CPU, its budget, its step runner.

The CPU run is the rehearsal of what a lent GPU machine runs (device time is scarce there):
every step must finish ok on CPU with finite figures, and one step's crash, hang or bad
result must be recorded as that step's failure while the next step still runs.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from capsule.tools.gpu_check import STEPS, TOTAL_BUDGET_S, Step
from capsule.tools.gpu_check import step as step_main
from capsule.tools.gpu_check.runner import run_steps

REPO = Path(__file__).resolve().parents[1]


def _floats(doc, path=""):
    if isinstance(doc, float):
        yield path, doc
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from _floats(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _floats(v, f"{path}[{i}]")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(REPO / "packaging" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_every_step_runs_ok_on_cpu_with_finite_figures(cpu_check):
    out, doc = cpu_check
    assert doc["device"] == "cpu" and doc["quick"] is True
    assert list(doc["steps"]) == [s.name for s in STEPS]
    limits = {s.name: s.timeout_s for s in STEPS}
    for name, fig in doc["steps"].items():
        assert fig["ok"] is True, (name, fig.get("error"), fig.get("output_tail"))
        assert 0 < fig["seconds"] <= limits[name] and fig["timeout_s"] == limits[name]
    bad = [(p, v) for p, v in _floats(doc) if not math.isfinite(v)]
    assert not bad
    assert doc["total_s"] >= sum(f["seconds"] for f in doc["steps"].values()) * 0.99
    md = (out / "gpu_check.md").read_text()
    assert all(f"## {s.name}: ok" in md for s in STEPS)
    assert (out / "gpu_check.log").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]


@pytest.mark.slow
def test_each_step_has_its_figures_on_cpu(cpu_check):
    s = cpu_check[1]["steps"]
    assert s["env"]["torch"] and "CPUExecutionProvider" in s["env"]["ort_providers"]
    assert s["env"]["missing_dependencies"] == [] and s["env"]["cuda_available"] is False
    t = s["pytest_cuda"]
    assert t["skipped"] > 0 and t["passed"] == t["failed"] == t["errors"] == 0   # no GPU: all skip
    g = s["llm_graphs"]
    assert {(r["dtype"], r["batch"]) for r in g["step_p50"]} == {(d, b) for d in ("float16", "float32")
                                                                  for b in (1, 4)}
    assert all(_positive(r["p50_ms"]) and r["graphs"] == "n/a (cpu)" for r in g["step_p50"])
    assert g["float32"]["max_abs_dlogits"] == "n/a (cpu)"
    r = s["restore"]
    assert all(r["checks"].values()) and r["registered_buffers"] >= 5
    assert all(_positive(r[k]) for k in ("checkpoint_ms", "rollback_ms", "first_token_after_rollback_ms",
                                         "fresh_open_restore_first_token_ms"))
    p = s["policy_engines"]
    ran = [e for e in p["engines"] if e["ran"]]
    assert {e["engine"] for e in ran} >= {"torch", "onnxruntime"} and p["session_act_engine"]
    assert all(e["max_err"] <= p["tolerance"] and _positive(e["p99_us"]) for e in ran)
    assert next(e for e in p["engines"] if e["engine"] == "tensorrt")["ran"] is False   # CUDA only
    a = s["act_while_chat"]
    assert a["chat_turns"] >= 1 and a["during_generate"]["acts"] >= 1 and _positive(a["with_chat"]["p99_us"])
    b = s["tensor_bpe"]
    assert b["exact"] is True and _positive(b["kernel_cpu_ms"]) and b["kernel_cuda_ms"] is None


def test_step_limits_fit_the_budget():
    assert sum(s.timeout_s for s in STEPS) <= TOTAL_BUDGET_S <= 300
    assert len({s.name for s in STEPS}) == len(STEPS)


FAKE = {  # step name -> the child's Python code; argv[1] is its result file
    "crashes": "import sys; print('boom'); sys.exit(3)",
    "hangs": "import time; print('waiting', flush=True); time.sleep(60)",
    "bad_json": "import sys; open(sys.argv[1], 'w').write('{not json')",
    "nan": "import sys; open(sys.argv[1], 'w').write('{\"ok\": true, \"x\": NaN}')",
    "fine": "import sys, json; json.dump({'ok': True, 'x': 1.5}, open(sys.argv[1], 'w'))",
}


def test_a_failing_step_does_not_stop_the_next(tmp_path):
    steps = [Step(name, name, 2 if name == "hangs" else 20, name) for name in FAKE]
    got = run_steps(steps, lambda st, result: [sys.executable, "-c", FAKE[st.name], str(result)], tmp_path,
                    env=None, cwd=tmp_path, echo=False)
    assert list(got) == list(FAKE)
    assert got["crashes"]["ok"] is False and "exited 3" in got["crashes"]["error"]
    assert "boom" in got["crashes"]["output_tail"]
    assert got["hangs"]["ok"] is False and "timed out after 2 s" in got["hangs"]["error"]
    assert "waiting" in got["hangs"]["output_tail"] and got["hangs"]["seconds"] < 15
    assert got["bad_json"]["ok"] is False and got["nan"]["ok"] is False   # strict JSON: no NaN either
    assert got["fine"] == {"ok": True, "x": 1.5, "seconds": got["fine"]["seconds"], "timeout_s": 20}
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"===== {name}:" in log for name in FAKE)
    assert not list(tmp_path.glob(".*"))   # the per-step result files are cleaned up


def test_a_forced_failure_is_reported_as_the_step_result(tmp_path, monkeypatch):
    monkeypatch.setenv(step_main.FAIL_ENV, "restore,tensor_bpe")
    result = tmp_path / "r.json"
    assert step_main.main(["restore", "--device", "cpu", "--result", str(result)]) == 1
    doc = json.loads(result.read_text())
    assert doc["ok"] is False and "forced failure" in doc["error"] and step_main.FAIL_ENV in doc["error"]


def test_non_finite_figures_are_named():
    assert step_main.non_finite({"a": 1.0, "b": [2.0, float("nan")], "c": {"d": float("inf")}}) == ["b[1]", "c.d"]


def test_parity_compares_logits_while_both_runs_fed_the_same_tokens(tmp_path):
    # the CUDA half of llm_graphs, run here on two eager Sessions over the same weights: exact
    import torch

    from capsule import Session
    from capsule.tools.gpu_check.llm_graphs import parity, parity_run

    runs = []
    for name in ("a", "b"):
        with Session.open(tmp_path / name, model="builtin:tiny", device="cpu", runtime={"kv_pool_mb": 8}) as s:
            runs.append(parity_run(s, 6))
    got = parity(runs[0], runs[1], vocab=runs[0][1][0].shape[0])
    assert got == {"parity_steps": 5, "argmax_agree": 1.0, "max_abs_dlogits": 0.0, "tokens_equal": True}
    ids, logits = runs[0]
    other = (ids[:2] + [ids[2] + 1] + ids[3:], [x + 0.5 for x in logits])   # diverges at token 2
    got = parity(runs[0], other, vocab=logits[0].shape[0])
    assert got["parity_steps"] == 2 and got["max_abs_dlogits"] == pytest.approx(0.5) and not got["tokens_equal"]
    assert isinstance(logits[0], torch.Tensor) and logits[0].dtype == torch.float32
