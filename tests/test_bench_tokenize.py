"""The tokenize benchmark suites run end to end on tiny sizes and report exact, divergence-free results."""
from __future__ import annotations

import json

from capsule.tools.bench import SUITES, BenchOptions, run_suite
from capsule.tokenize import all_families, family_names
from tokenizer_facts import tensor_bpe_families


def _run(name: str, tmp_path, steps: int) -> dict:
    opts = BenchOptions(model="builtin:tiny", device="cpu", quick=True, steps=steps, progress=False)
    run = run_suite(name, opts, out_dir=tmp_path)
    assert run.md_path.exists()
    return json.loads(run.json_path.read_text())


def test_suites_registered():
    assert {"tokenize", "tokenize-diff", "tokenize-bpe", "memory", "control"} <= set(SUITES)


def test_tokenize_suite(tmp_path):
    data = _run("tokenize", tmp_path, steps=3)
    assert data["settings"]["shadow_rate"] == 0.0 and data["settings"]["appends"] == 3
    runs = data["results"]["runs"]
    libraries = {f.library for f in all_families()}   # one family per library: its first
    assert {r["family"] for r in runs} == {next(f.name for f in all_families() if f.library == lib)
                                           for lib in libraries}
    assert {r["context_chars"] for r in runs} == {100_000, 1_000_000}
    for r in runs:
        assert r["appends"] == 3
        assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["full_encode_ms"] > 0
        assert r["ratio_full_over_p50"] > 0
        # the Gigatoken baseline (installed by make, --no-deps): timed and exact on the same text
        assert r["gigatoken_full_ms"] > 0 and r["ratio_gigatoken_over_p50"] > 0, r["gigatoken_note"]
        assert r["gigatoken_exact"] is True
        assert r["exact"] is True
    assert data["results"]["exact"] is True
    assert any(t["target"].startswith("exact") and t["met"] == "yes" for t in data["results"]["targets"])


def test_tokenize_diff_suite(tmp_path):
    data = _run("tokenize-diff", tmp_path, steps=300)
    fams = data["results"]["families"]
    assert set(fams) == set(family_names())
    for name, f in fams.items():
        assert f["checks"] == 300 and f["divergences"] == 0
        assert (f["bpe_checks"] > 0) == (name in tensor_bpe_families()) and f["bpe_divergences"] == 0
    total = {"checks": 300 * len(fams), "divergences": 0}
    assert data["results"]["total"] == {**data["results"]["total"], **total}
    assert data["results"]["divergences"] == []


def test_tokenize_bpe_suite(tmp_path, monkeypatch):
    from capsule.tools.bench import tokenize_bpe
    monkeypatch.setattr(tokenize_bpe, "QUICK_CHARS", 20_000)
    data = _run("tokenize-bpe", tmp_path, steps=1)
    runs = data["results"]["runs"]
    assert {r["family"] for r in runs} == set(tensor_bpe_families())
    assert set(data["settings"]["not_run"]) == set(family_names()) - set(tensor_bpe_families())
    for r in runs:
        assert r["chars"] == 20_000 and r["exact"] is True
        assert r["kernel_cpu_ms"] > 0 and r["reference_ms"] > 0 and r["kernel_pieces"] > 0
        # the regex split on tensors, for the GPT-family patterns: timed and piece-exact
        gpt = r["family"] in ("cl100k_base", "r50k_base", "p50k_base", "llama3", "qwen2.5", "qwen3",
                              "glm4", "glm4.5", "gpt-neox")
        assert (r["split_cpu_ms"] is not None) == gpt and r["split_exact"] in ((True,) if gpt else (None,))
    exact = [t for t in data["results"]["targets"] if t["target"].startswith("exact")]
    assert exact and exact[0]["met"] == "yes"


def test_tokenize_tails_suite(tmp_path, monkeypatch):
    from capsule.tools.bench import tokenize_tails
    monkeypatch.setattr(tokenize_tails, "TAIL_KIB", 64)   # quick: 8 KiB tails
    data = _run("tokenize-tails", tmp_path, steps=3)
    runs = data["results"]["runs"]
    shapes = {f.splice for f in all_families() if f.splice}
    assert set(data["settings"]["families"]) == shapes
    assert {r["tail"] for r in runs} == {"base64", "digits", "whitespace"}
    assert len(runs) == 3 * len(shapes) and data["results"]["exact"] is True
    for r in runs:
        assert r["appends"] == 3 and r["tail_chars"] > 8 * 1024 and r["exact"] is True
        assert r["p99_ms"] >= r["p50_ms"] > 0 and r["full_encode_ms"] > 0 and r["first_ms"] > 0
    # a digit run is cut by Rule 3 (also where special tokens hold digit pairs: qwen2.5's
    # '<|extra_10|>'); a whitespace run and GPT-2's ' ?\p{N}+' run are one long piece whose BPE
    # is redone near the end only (Falcon's too: an ASCII piece is surely one of its pieces);
    # GPT-NeoX cuts whitespace into 24-space added tokens, whose ends are stable (Rule 4)
    small = {(r["shape"], r["tail"]) for r in runs if r["last_window_chars"] < 2000}
    assert small == {(r["shape"], r["tail"]) for r in runs}
