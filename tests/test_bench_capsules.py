"""`capsule bench --suite capsules` on builtin:tiny, quick: every section present, numbers consistent.

No timing thresholds: only that each figure exists, is positive, and agrees with its parts.
"""
from __future__ import annotations

import json

import pytest

from capsule.tools.bench import SUITES, BenchOptions, run_suite

pytestmark = pytest.mark.slow
STEPS = 10


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-capsules")
    run = run_suite("capsules", BenchOptions(model="builtin:tiny", device="cpu", quick=True, steps=STEPS,
                                             progress=False), out_dir=out)
    assert run.md_path.exists() and "targets" in run.md_path.read_text()
    return json.loads(run.json_path.read_text())


def test_registered():
    assert "capsules" in SUITES


def test_sections_and_settings(report):
    res = report["results"]
    assert set(res) >= {"restore", "delta", "stall", "throughput", "fsync", "targets", "load_avg_1min"}
    s = report["settings"]
    assert s["suite"] == "capsules" and s["model"] == "builtin:tiny" and s["contexts"] == [256, 1024]
    assert s["runtime"]["max_context"] >= 8192 and s["kv_bytes_per_token"] > 0 and s["notes"]
    assert report["machine"]["cpu_cores"] >= 1
    assert {t["target"] for t in res["targets"]} >= {"p99 added stall < 1 ms"}


def test_restore_rows_are_consistent(report):
    restore = report["results"]["restore"]
    rows = restore["contexts"]
    assert [r["target_tokens"] for r in rows] == [256, 1024]
    for r in rows:
        assert abs(r["context_tokens"] - r["target_tokens"]) <= 4
        for key in ("cold_s", "restore_s", "cold_open_s", "cold_prefill_first_token_s", "restore_open_s",
                    "restore_in_open_s", "restore_first_token_s", "restore_bytes", "store_disk_bytes"):
            assert r[key] > 0, key
        assert r["ratio"] == pytest.approx(r["cold_s"] / r["restore_s"], rel=1e-9)
        assert r["ratio_of_min"] == pytest.approx(r["cold_min_s"] / r["restore_min_s"], rel=1e-9)
        assert len(r["cold_runs_s"]) == len(r["restore_runs_s"]) == report["settings"]["reps"]
        assert r["restore_in_open_s"] <= r["restore_open_s"]   # per run, hence per median
        # spawn -> first token: interpreter start and imports come on top of open + first token
        assert r["restore_import_s"] > 0 and r["restore_interpreter_s"] >= 0
        assert r["restore_process_s"] > r["restore_s"] and r["cold_process_s"] > r["cold_s"]
        assert r["restore_bytes"] <= r["store_disk_bytes"]      # the folder is an upper bound
        # the capsule holds at least the transcript's KV
        assert r["restore_bytes"] >= r["context_tokens"] * report["settings"]["kv_bytes_per_token"]
    assert rows[1]["restore_bytes"] > rows[0]["restore_bytes"]
    assert restore["ratio_at_4096"] is None and restore["target_met"] is None  # no 4K context here


def test_delta_epochs_write_less_than_the_full_state(report):
    delta = report["results"]["delta"]
    assert delta["epochs"] == len(delta["per_epoch"]) == STEPS
    assert delta["missing_kv_pages"] == 0
    for e in delta["per_epoch"]:
        assert 0 < e["dirty_page_bytes"] <= e["bytes_written"] < e["full_state_bytes"]
        assert e["new_kv_tokens"] == 8 and e["kv_pages_expected"] >= 1 and e["manifest_bytes"] > 0
    assert 0 < delta["written_over_full_p50"] < 1
    assert delta["full_save_over_written_p50"] > 1
    assert delta["write_amplification_p50"] >= 1
    assert delta["write_amplification_max"] >= delta["write_amplification_p50"]


def test_stall_loop(report):
    stall = report["results"]["stall"]
    off, on = stall["without"], stall["with"]
    assert off["steps"] == on["steps"] == STEPS and not off["checkpoints"] and on["checkpoints"]
    for run in (off, on):
        assert 0 < run["work_p50_ms"] <= run["work_p99_ms"] <= run["work_max_ms"]
        assert 0 <= run["deadline_misses"] <= STEPS
        assert len(run["work_ms"]) == STEPS and max(run["work_ms"]) == run["work_max_ms"]   # the histogram's
    assert 0 < on["stall_p50_ms"] <= on["stall_p99_ms"] <= on["stall_max_ms"]
    assert stall["added_stall_p99_ms"] == on["stall_p99_ms"]
    assert on["epochs_committed"] == STEPS and on["last_epoch_durable"]
    assert on["sync_calls"] >= 1 and on["epochs_per_sync"] == pytest.approx(STEPS / on["sync_calls"])


def test_throughput_and_fsync(report):
    res = report["results"]
    tput, fsync = res["throughput"], res["fsync"]
    assert tput["restore_mb_s"] > 0 and tput["cached_read_mb_s"] > 0 and tput["write_fsync_mb_s"] > 0
    assert tput["restore_over_cached_read"] == pytest.approx(tput["restore_mb_s"] / tput["cached_read_mb_s"])
    assert (tput["direct_read_mb_s"] or 0) > 0 or tput["direct_read_error"]
    assert tput["restore_bytes"] == res["restore"]["contexts"][-1]["restore_bytes"]
    assert fsync["reps"] == 50 and 0 < fsync["p50_ms"] <= fsync["p99_ms"]
