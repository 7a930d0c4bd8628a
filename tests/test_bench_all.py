"""`capsule bench` over several suites (issue 16): one folder with a combined results.json, a
report.md and the PNG plots; a failing suite is reported and the others still run."""
from __future__ import annotations

import json

import pytest

from capsule.cli import main
from capsule.tools.bench import BenchOptions, SuiteResult, SuiteRun
from capsule.tools.bench import run_all
from capsule.tools.bench.plots import PLOTS, draw_plots

PNG = b"\x89PNG\r\n\x1a\n"


def test_suite_lists_parse_in_order_and_refuse_unknown_names():
    every = [n for n in run_all.ORDER if n not in run_all.OPT_IN]
    assert run_all.parse_suites(None) == every == run_all.parse_suites("")
    assert "peers" in run_all.OPT_IN and "peers" not in every   # builds llama.cpp: only when named
    assert run_all.parse_suites("peers") == ["peers"]
    assert run_all.parse_suites("control, tokenize") == ["control", "tokenize"]
    for bad in ("nope", "decode,decode", ","):
        with pytest.raises(ValueError, match="distinct names from: decode, capsules"):
            run_all.parse_suites(bad)


def _synthetic() -> dict:
    return {"capsules": {"restore": {"contexts": [{"context_tokens": c, "cold_s": c / 1e4, "restore_s": c / 1e5}
                                                  for c in (256, 1024, 4096)]},
                         "stall": {k: {"work_ms": [1.0 + (i % 7) * 0.1 for i in range(50)]} for k in ("without", "with")},
                         "delta": {"per_epoch": [{"epoch": e, "bytes_written": 1e5, "new_token_bytes": 5e4,
                                                  "full_state_bytes": 2.5e7} for e in range(2, 8)]}},
            "tokenize": {"runs": [{"family": "cl100k_base", "context_chars": c, "p50_ms": 0.4, "full_encode_ms": c / 1e4}
                                  for c in (1e5, 1e6)]},
            "memory": {"ttft": [{"k": k, "injected_ttft_ms": 30 + k / 5, "prefill_ttft_ms": 30 + 7 * k} for k in (1, 10, 50)]}}


def test_every_plot_draws_from_the_suites_results(tmp_path):
    status = draw_plots(_synthetic(), tmp_path)
    assert status == {name: "ok" for name in PLOTS}
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == PNG
    (tmp_path / "p").mkdir()
    partial = draw_plots({"tokenize": _synthetic()["tokenize"]}, tmp_path / "p")
    assert partial["tokenize_append.png"] == "ok" and "needs the capsules suite" in partial["restore_vs_cold.png"]


def test_a_failing_suite_is_reported_and_the_others_run(tmp_path, monkeypatch):
    ran = []

    def fake_run_suite(name, opts, out_dir):
        ran.append((name, opts.only, opts.steps))
        if name == "control":
            raise RuntimeError("the robot fell over")
        out_dir.mkdir(parents=True)
        res = SuiteResult({"model": opts.model}, _synthetic()[name], {"t": [{"a": 1}]})
        return SuiteRun(res, out_dir / "results.json", out_dir / "results.md")

    monkeypatch.setattr(run_all, "run_suite", fake_run_suite)
    done = run_all.run_suites(["tokenize", "control", "memory", "capsules"], BenchOptions(quick=True, device="cpu"), tmp_path)
    assert done.failed == ("control",)
    # --quick trims the long suites: the memory suite's quick sections
    assert ran[2] == ("memory", run_all.QUICK_SECTIONS["memory"], None) and ran[0] == ("tokenize", (), None)
    doc = json.loads(done.json_path.read_text())
    assert list(doc["suites"]) == ["tokenize", "control", "memory", "capsules"]
    assert "the robot fell over" in doc["suites"]["control"]["error"]
    for entry in doc["suites"].values():
        assert entry["seconds"] >= 0 and "load_before" in entry and "load_after" in entry
    assert doc["machine"]["cpu_cores"] >= 1 and doc["disk_free_gb"] > 0
    assert all(v == "ok" for v in doc["plots"].values()), doc["plots"]
    md = done.md_path.read_text()
    assert "## control\n\nFAILED: RuntimeError: the robot fell over" in md and "![ttft_vs_k.png](ttft_vs_k.png)" in md


def test_two_real_suites_in_one_report(tmp_path, capsys):
    assert main(["bench", "--suite", "tokenize,tokenize-bpe", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc["suites"]) == {"tokenize", "tokenize-bpe"} and not any("error" in e for e in doc["suites"].values())
    assert (tmp_path / "tokenize" / "results.json").is_file() and (tmp_path / "tokenize-bpe" / "results.md").is_file()
    assert doc["plots"]["tokenize_append.png"] == "ok" and (tmp_path / "tokenize_append.png").read_bytes()[:8] == PNG
    assert "needs the capsules suite" in doc["plots"]["restore_vs_cold.png"]
    assert "and the plots in" in capsys.readouterr().out


def test_bench_help_lists_every_suite(capsys):
    assert main(["bench", "--device", "cpu", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in run_all.ORDER:
        assert name in out


def test_ctrl_c_leaves_no_temporary_folder(tmp_path):
    import os
    import signal
    import sys

    from signalled import signal_after_line
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code, out, err = signal_after_line([sys.executable, "-m", "capsule.cli", "bench", "--suite", "capsules",
                                        "--quick", "--device", "cpu", "--out", str(tmp_path / "out")],
                                       "capsules: restore vs cold", signal.SIGINT, delay_s=3, stream="stderr",
                                       env={**os.environ, "TMPDIR": str(tmp)})
    assert code == 130 and "interrupted" in out + err
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("capsule")], list(tmp.iterdir())
