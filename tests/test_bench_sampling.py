"""The decode suite's sampling line: greedy and sampled steps at batch 4, measured together."""
from __future__ import annotations

from capsule.tools.bench import BenchOptions
from capsule.tools.bench.decode_sampling import MODES, measure, report


def test_sampling_line_measures_both_modes_at_batch_4():
    opts = BenchOptions(model="builtin:tiny", device="cpu", quick=True, progress=False)
    results: dict = {}
    tables: dict = {}
    report(opts, results, tables)
    rows = results["sampling"]
    assert [r["mode"] for r in rows] == list(MODES)
    assert all(r["batch"] == 4 and r["steps"] > 0 and r["p50_ms"] > 0 for r in rows)
    assert rows[0]["vs_greedy"] == 1.0 and rows[1]["vs_greedy"] > 0
    assert list(tables.values()) == [rows]


def test_sampling_line_is_empty_without_a_batch_4_bucket(tmp_path):
    path = tmp_path / "b2.yaml"
    path.write_text("name: b2\ndescription: two rows\ndevice: cpu\nruntime:\n  dtype: float32\n"
                    "  kv_pool_mb: 8\n  block_size: 16\n  batch_buckets: [1, 2]\n  max_context: 512\n"
                    "  prefill_chunk: 64\n  cuda_graphs: false\nengines: [torch]\n"
                    "checkpoint:\n  keep_epochs: 2\n")
    assert measure(BenchOptions(model="builtin:tiny", device=str(path), quick=True, progress=False)) == []
