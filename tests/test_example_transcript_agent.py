"""examples/transcript_agent.py (issue 16): hundreds of small appends on the windowed path, the ids
equal to a full encode at every check, one report line per block of turns."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transcript_agent.py"


@pytest.mark.parametrize("family", ["cl100k_base", "qwen2.5"])
def test_hundreds_of_appends_stay_exact(family):
    res = subprocess.run([sys.executable, str(EXAMPLE), "--turns", "300", "--check", "10", "--report", "100",
                          "--tokenizer", family], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"tokenizer {family}: windowed" in res.stdout
    rows = re.findall(r"^ +(\d+) +(\d+) +(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", res.stdout, re.M)
    assert [int(r[0]) for r in rows] == [100, 200, 300]
    assert int(rows[-1][2]) > int(rows[0][2]) > 0           # the transcript grew
    assert "ids equal the full encode at every check" in res.stdout


def test_a_bad_count_is_refused():
    res = subprocess.run([sys.executable, str(EXAMPLE), "--turns", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "must be >= 1" in res.stderr
