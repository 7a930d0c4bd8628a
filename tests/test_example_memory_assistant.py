"""examples/memory_assistant.py (issue 16): facts outlive the process, recall finds the relevant one,
and both answers (injected, in the prompt) are printed with their time to first token."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "memory_assistant.py"


def _run(*args: str) -> str:
    res = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cpu", *args], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_facts_survive_a_restart_and_answer_both_ways(tmp_path):
    store = str(tmp_path / "mem")
    first = _run("--store", store, "--remember", "The spare battery is in the red toolbox.")
    assert first.count("remembered #") == 1
    second = _run("--store", store, "--ask", "Where is the spare battery?")
    assert "remembered" not in second                               # nothing new: read from the store
    assert "most relevant facts: ['The spare battery is in the red toolbox.']" in second
    for way in ("injected", "in prompt"):
        assert re.search(rf"answer \(facts {way}\): +'.*' +TTFT \d+ ms", second), second
