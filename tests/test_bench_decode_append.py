"""The decode suite's Session.append line: its rows, and the byte bound it reports (bytes are
counted, so that part is exact; the latencies are reported, never asserted)."""
from __future__ import annotations

from capsule.tools.bench import BenchOptions
from capsule.tools.bench.decode_append import APPEND_CHARS, append_text, measure


def test_append_line_rows_and_the_checkpoint_byte_bound():
    out = measure(BenchOptions(model="builtin:tiny", device="cpu", quick=True, progress=False),
                  show=False, max_context=2048)
    rows = out["rows"]
    assert [r["history_tokens"] >= 1000 for r in rows] == [True] * len(rows) and len(rows) == 2
    assert rows[-1]["history_tokens"] > rows[0]["history_tokens"]
    assert out["max_context"] == 2048 and out["append_chars"] == APPEND_CHARS == len(append_text(3))
    assert out["checkpoint_within_2x_new_plus_constant"] is True
    for r in rows:
        assert r["append_ms_p50"] > 0 and r["new_bytes_p50"] > APPEND_CHARS
        assert r["bound_ok"] and r["host_over_new_p50"] < 2 + 2 * 4096 / r["new_bytes_p50"]
