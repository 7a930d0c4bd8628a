"""Bench helpers: percentiles, tables, the decode-step probe, prompts, options, the suite registry."""
from __future__ import annotations

import pytest

from capsule.tools.bench import SUITES, BenchOptions, run_suite
from capsule.tools.bench.decode import robot_prompt
from capsule.tools.bench.report import format_table, machine_info
from capsule.tools.bench.timing import percentile, step_probe
from capsule.tokenize import load_reference


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0
    assert percentile(values, 0) == 1.0
    with pytest.raises(ValueError, match="0..100"):
        percentile(values, 101)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_format_table_markdown_and_plain():
    rows = [{"batch": 1, "p50_ms": 10.44, "tokens_per_s": 12345.6, "graphs": None}]
    md = format_table(rows, markdown=True)
    assert md.splitlines() == ["| batch | p50_ms | tokens_per_s | graphs |", "|---|---|---|---|",
                               "| 1 | 10.4 | 12,346 | - |"]
    plain = format_table(rows, markdown=False).splitlines()
    assert plain[0].split() == ["batch", "p50_ms", "tokens_per_s", "graphs"]
    assert len(plain[0]) == len(plain[1])


def test_step_probe_times_calls_and_restores_the_method():
    class Runner:
        def decode(self, rows):
            return len(rows)

    runner = Runner()
    with step_probe(runner, clock=iter(range(100)).__next__) as samples:
        assert runner.decode([1, 2]) == 2
        assert runner.decode([1]) == 1
    assert samples == [(2, 1), (1, 1)]
    assert "decode" not in vars(runner)  # the class method shows through again


def test_robot_prompt_reaches_the_length_in_whole_lines():
    tok = load_reference("cl100k_base")
    text = robot_prompt(tok, 200, seed=3)
    assert text.endswith("\n")
    n = len(tok.encode(text))
    assert 200 <= n < 240
    assert robot_prompt(tok, 200, seed=3) == text


def test_options_validate():
    with pytest.raises(ValueError, match="steps must be"):
        BenchOptions(device="cpu", steps=True)
    with pytest.raises(ValueError, match="model must be"):
        BenchOptions(device="cpu", model="")


def test_registry_is_read_only_and_rejects_unknown_suites(tmp_path):
    assert "decode" in SUITES
    with pytest.raises(TypeError):
        SUITES["x"] = None  # type: ignore[index]
    with pytest.raises(ValueError, match=r"available:.*decode"):
        run_suite("nope", BenchOptions(device="cpu"), tmp_path)


def test_machine_info_has_the_basics():
    info = machine_info()
    assert info["python"] and info["torch"] and info["cpu"]
    assert info["cpu_cores"] >= 1
