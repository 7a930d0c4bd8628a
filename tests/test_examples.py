"""The example app runs, and a second run continues from the first one's capsule."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "robot_agent.py"


def _run(store: Path, steps: int) -> str:
    res = subprocess.run([sys.executable, str(EXAMPLE), "--store", str(store), "--steps", str(steps),
                          "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_robot_agent_continues_after_a_restart(tmp_path):
    first = _run(tmp_path / "agent", 2)
    assert "fresh start" in first and "epoch    2" in first
    second = _run(tmp_path / "agent", 1)
    assert "restored epoch 2 at step 2" in second and "epoch    3" in second


CONTROL = Path(__file__).resolve().parents[1] / "examples" / "robot_control.py"


def test_robot_control_continues_its_episode(tmp_path):
    def run() -> str:
        res = subprocess.run([sys.executable, str(CONTROL), "--store", str(tmp_path / "arm"),
                              "--steps", "30", "--device", "cpu"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout
    first = run()
    assert "fresh episode" in first and "ticks 0..29" in first
    second = run()
    assert "restored epoch 3 at tick 30" in second and "ticks 30..59" in second
