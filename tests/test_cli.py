"""The `capsule` command line, run in-process on the CPU with builtin:tiny (fast)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from capsule import ModelLoadError, __version__
from capsule.cli import main
from capsule.tools.doctor import FAILED, MISSING, OK, Check, NeedsPackage, run_checks

REPO = Path(__file__).resolve().parents[1]


def test_version_in_process(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"capsule {__version__} ")
    assert "torch " in out


def test_version_as_module_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "sdk")]))
    proc = subprocess.run([sys.executable, "-m", "capsule.cli", "--version"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"capsule {__version__} ")


def test_demo_prints_profile_and_timings_and_removes_its_temp_store(capsys):
    assert main(["demo", "--model", "builtin:tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "x86-cpu" in out and "UNTRAINED" in out
    for label in ("open", "append", "prefill", "generate", "batch"):
        assert re.search(rf"^{label}\s+\d+\.\d ms", out, re.M), f"no timing line for {label}:\n{out}"
    assert "ms/token decode" in out
    store = re.search(r"\(store (\S+), temporary", out).group(1)
    assert not Path(store).exists()


def test_demo_keeps_a_given_store(tmp_path, capsys):
    store = tmp_path / "robot.capsules"
    assert main(["demo", "--device", "cpu", "--store", str(store)]) == 0
    assert store.is_dir()
    assert "store kept at" in capsys.readouterr().out


def test_unknown_model_is_a_one_line_error(capsys):
    assert main(["demo", "--model", "builtin:nope", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "builtin:tiny" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--debug", "demo", "--model", "builtin:nope"],
                                  ["demo", "--model", "builtin:nope", "--debug"]])
def test_debug_shows_the_exception(argv):
    with pytest.raises(ModelLoadError):
        main(argv + ["--device", "cpu"])


def test_doctor_reports_torch_cpu_ok_without_onnxruntime(monkeypatch, capsys):
    # None in sys.modules makes `import x` raise ImportError, whatever is installed
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^torch cpu\s+OK\s+\S+\s+matmul exact", out, re.M), out
    assert re.search(r"^onnxruntime\s+MISSING\s+-\s+not importable", out, re.M), out
    assert re.search(r"^tensorrt\s+MISSING", out, re.M), out
    assert re.search(r"^llm onnxruntime\s+MISSING\s+-\s+the LLM engine 'onnxruntime' needs", out, re.M), out
    assert re.search(r"^llm tensorrt\s+MISSING\s+-\s+(the tensorrt LLM engine needs a CUDA model|tensorrt is not importable)", out, re.M), out


def test_doctor_checks_the_onnxruntime_llm_engine_against_torch():
    from capsule.tools.doctor import probe_llm_onnxruntime

    (check,) = run_checks([("llm onnxruntime", probe_llm_onnxruntime)])
    assert check.status == OK, check
    diff = float(re.search(r"max \|diff\| (\S+) vs torch", check.reason).group(1))
    assert diff < 1e-4


def test_doctor_onnxruntime_without_onnx_says_what_to_install(monkeypatch):
    fake = types.ModuleType("onnxruntime")
    fake.__version__ = "9.9.9"
    fake.get_available_providers = lambda: ["CPUExecutionProvider"]
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    monkeypatch.setitem(sys.modules, "onnx", None)
    from capsule.policy.engine_ort import probe_onnxruntime

    (check,) = run_checks([("onnxruntime", probe_onnxruntime)])
    assert (check.status, check.version) == (MISSING, "9.9.9")
    assert "onnx" in check.reason and "pip install" in check.reason


def test_a_failing_probe_becomes_a_line_not_a_crash():
    def boom(work: Path) -> Check:
        raise RuntimeError("driver exploded\nsecond line")

    def needs(work: Path) -> Check:
        raise NeedsPackage("needs foo")

    checks = run_checks([("boom", boom), ("needs", needs),
                         ("fine", lambda work: Check("fine", OK, "1.0", "ran"))])
    assert [(c.name, c.status) for c in checks] == [("boom", FAILED), ("needs", MISSING), ("fine", OK)]
    assert checks[0].reason == "RuntimeError: driver exploded"


def test_bench_unknown_suite_lists_suites(capsys):
    assert main(["bench", "--suite", "nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--suite takes distinct names from" in err and "'nope'" in err and "reliability" in err


def test_bench_bad_steps_is_a_value_error(capsys):
    assert main(["bench", "--suite", "decode", "--device", "cpu", "--steps", "0"]) == 1
    assert "steps must be an int >= 1" in capsys.readouterr().err


def test_bench_decode_writes_results(tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["bench", "--suite", "decode", "--model", "builtin:tiny", "--device", "cpu", "--quick",
            "--steps", "4", "--out", str(out_dir)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "decode steps" in printed and "p50_ms" in printed
    data = json.loads((out_dir / "results.json").read_text())
    assert set(data) >= {"suite", "created", "machine", "settings", "results", "tables"}
    assert data["suite"] == "decode" and data["settings"]["model"] == "builtin:tiny"
    assert data["machine"]["torch"] and data["machine"]["cpu_cores"] >= 1
    res = data["results"]
    assert res["open_s"] > 0 and res["peak_rss_mb"] > 0
    assert res["prefill"] and all(r["tokens_per_s"] > 0 and r["prompt_tokens"] >= 512 for r in res["prefill"])
    assert [r["batch"] for r in res["decode"]] == [1, 2, 4]
    for row in res["decode"]:
        assert row["steps"] == 4 and row["graphs"] == "n/a"
        assert 0 < row["p50_ms"] <= row["p99_ms"] and row["tokens_per_s"] > 0
    assert "| batch | graphs |" in (out_dir / "results.md").read_text()
    # a CPU run measures both LLM engines (onnxruntime is in the test install) at 1 and 2
    # threads (as many as there are cores)
    threads = res["threads"]
    counts = [t for t in (1, 2) if t <= threads["cores"]]
    assert [(r["engine"], r["threads"]) for r in threads["rows"]] == \
        [(e, t) for e in ("torch", "onnxruntime") for t in counts]
    for row in threads["rows"]:
        assert row["prefill_tokens_per_s"] > 0 and row["decode_steps"] >= 1
        assert 0 < row["decode_ms_p50"] <= row["decode_ms_p99"]
        assert row["batch4_ms_per_token_p50"] > 0


def _store_with_epochs(path):
    from capsule import Session
    with Session.open(path, device="cpu", runtime={"kv_pool_mb": 8, "max_context": 512}) as s:
        s.append("user: bring me the red cup\n")
        s.generate(4)
        s.state = {"goal": "cup"}
        s.checkpoint(name="start")
        s.generate(4)
        s.checkpoint()
    return path


def test_inspect_lists_epochs_fingerprints_and_streams(tmp_path, capsys):
    store = _store_with_epochs(tmp_path / "s")
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert "2 epoch(s)" in out and "start" in out and "binding.model:" in out
    assert "stream 'main':" in out and "app state keys: goal" in out


def test_verify_reports_damage_with_a_nonzero_exit(tmp_path, capsys):
    store = _store_with_epochs(tmp_path / "s")
    assert main(["verify", str(store)]) == 0
    assert "OK" in capsys.readouterr().out
    seg = sorted((store / "segments").glob("*.seg"))[0]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "problem:" in out


def test_verify_lists_damaged_memory_facts(tmp_path, capsys):
    import sqlite3

    from capsule import Session

    store = tmp_path / "s"
    with Session.open(store, model="builtin:tiny", device="cpu", memory={"embedder": None},
                      runtime={"kv_pool_mb": 8, "max_context": 512}) as s:
        ids = [s.remember(t) for t in ("The red cup is fragile.", "The charger is in bay 2.",
                                       "Alice likes green tea.", "Bay 3 holds the spare batteries.",
                                       "The robot's name is Rex.")]
    assert main(["verify", str(store)]) == 0
    assert "OK" in capsys.readouterr().out
    con = sqlite3.connect(store / "index.sqlite")
    for change in ("'$.tags', '{not json'", "'$.n_tokens', json_extract(row, '$.n_tokens') + 1",
                   "'$.text', 'Alice likes black coffee.'", "'$.n_tokens', 'many'"):
        con.execute(f"UPDATE records SET row = json_set(row, {change}) WHERE collection = 'fact' AND id = ?",
                    (ids.pop(0),))
    con.commit()
    con.close()
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "damaged memory facts (never injected): 1, 2, 3, 4;" in out, out
    assert "problem: fact 1: index row: tags: tags must be a sequence of str (e.g. a tuple), got str" in out
    edited = "differs from the row its record was written with (the index was edited"   # the record holds its row
    assert f"problem: fact 2: {edited}" in out and f"problem: fact 3: {edited}" in out
    assert "problem: fact 4: index row: n_tokens: " in out and "fact 5" not in out


def test_verify_reads_the_factkv_header_as_memory_writes_it():
    import torch

    from capsule.tools import store_report as cli_inspect
    from capsule.memory import encode

    assert cli_inspect._FACTKV_HEADER.format == encode.HEADER.format
    assert (cli_inspect._FACTKV_MAGIC, cli_inspect._FACTKV_VERSION) == (encode.MAGIC, encode.VERSION)
    assert cli_inspect._FACTKV_ITEM_BYTES == {code: torch.empty(0, dtype=dt).element_size()
                                              for code, (dt, _, _) in encode._DTYPES.items()}
    kv = encode.FactKV(torch.ones(2, 3, 1, 4, dtype=torch.float16), torch.zeros(2, 3, 1, 4, dtype=torch.float16))
    data = kv.to_bytes()
    assert cli_inspect._factkv_problem(data, 3) == ""
    assert "T=3 tokens; its row says n_tokens=4" in cli_inspect._factkv_problem(data, 4)
    assert "implies" in cli_inspect._factkv_problem(data[:-1], 3)
    assert "not a FactKV" in cli_inspect._factkv_problem(b"x" * 40, 3)
    assert "shorter than a FactKV header" in cli_inspect._factkv_problem(b"x", 3)


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_inspect_and_verify_need_an_existing_store(verb, tmp_path, capsys):
    assert main([verb, str(tmp_path / "missing")]) == 1
    assert "not a capsule store" in capsys.readouterr().err


def test_no_command_prints_usage(capsys):
    assert main([]) == 2
    assert "usage: capsule" in capsys.readouterr().err


def test_onnxruntime_provider_fallback_and_mismatch_are_failed(tmp_path):
    import numpy as np

    from capsule.policy.engine_ort import _run_provider

    x = np.ones((2, 16), dtype=np.float32)
    want = np.full((2, 8), 0.5, dtype=np.float32)

    def fake_ort(used: str, offset: float) -> types.SimpleNamespace:
        class Sess:
            def __init__(self, path, providers):
                self.providers = providers

            def get_providers(self):
                return [used, "CPUExecutionProvider"]

            def run(self, names, feeds):
                assert names == ["y"] and feeds["x"] is x
                return [want + offset]
        return types.SimpleNamespace(__version__="9.9.9", InferenceSession=Sess)

    path = tmp_path / "probe.onnx"
    ok = _run_provider(fake_ort("CUDAExecutionProvider", 0.0), "CUDAExecutionProvider", path, x, want)
    assert (ok.name, ok.status) == ("onnxruntime CUDA", OK)
    fell = _run_provider(fake_ort("CPUExecutionProvider", 0.0), "CUDAExecutionProvider", path, x, want)
    assert fell.status == FAILED and "fell back" in fell.reason
    off = _run_provider(fake_ort("CPUExecutionProvider", 1e-3), "CPUExecutionProvider", path, x, want)
    assert off.status == FAILED and "differs" in off.reason


def test_doctor_leaves_out_the_azure_provider(monkeypatch, tmp_path):
    # onnxruntime lists AzureExecutionProvider (a cloud endpoint, not a local backend) on any machine
    import numpy as np

    from capsule.policy import engine_ort as doctor_onnx

    want = np.full((2, 8), 0.5, dtype=np.float32)
    ran = []

    class Sess:
        def __init__(self, path, providers):
            ran.extend(providers)
            self.providers = providers

        def get_providers(self):
            return self.providers

        def run(self, names, feeds):
            return [want]
    fake = types.SimpleNamespace(__version__="9.9.9", InferenceSession=Sess,
                                 get_available_providers=lambda: ["AzureExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    monkeypatch.setattr(doctor_onnx, "export_probe", lambda work: (work / "p.onnx", np.ones((2, 16)), want))
    checks = doctor_onnx.probe_onnxruntime(tmp_path)
    assert [(c.name, c.status) for c in checks] == [("onnxruntime CPU", OK)] and ran == ["CPUExecutionProvider"]
