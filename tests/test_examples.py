"""The example app runs, and a second run continues from the first one's capsule."""
from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "robot_agent.py"


# a small context so that the runs below shift it (the trained model, its chat template)
AGENT = ["--device", "cpu", "--threads", "1", "--max-context", "256"]
STEP = re.compile(r"^step +(\d+) epoch +(\d+) ctx +(\d+) +(.*)$", re.M)


def _run(store: Path, steps: int, *extra: str, code: int = 0) -> str:
    res = subprocess.run([sys.executable, str(EXAMPLE), "--store", str(store), "--steps", str(steps),
                          *AGENT, *extra], capture_output=True, text=True, timeout=300)
    assert res.returncode == code, res.stderr
    return res.stdout


def _steps(out: str) -> dict[int, str]:
    return {int(m[1]): m[4] for m in STEP.finditer(out)}


def test_robot_agent_continues_after_a_restart(tmp_path):
    first = _run(tmp_path / "agent", 2)
    assert "fresh start" in first and "epoch    2" in first
    second = _run(tmp_path / "agent", 1)
    assert "restored epoch 2 at step 2" in second and "epoch    3" in second


def test_robot_agent_survives_power_cuts_and_continues_exactly(tmp_path):
    """SIGKILL at a chosen step and at a random moment: the resumed runs print exactly the
    replies of an uninterrupted run, across context shifts (256 positions fill by step 7)."""
    out = _run(tmp_path / "twin", 9)
    twin = _steps(out)
    assert sorted(twin) == list(range(9)) and len(set(twin.values())) > 3   # real, varied replies
    ctx = [int(m[3]) for m in STEP.finditer(out)]
    assert any(b < a for a, b in zip(ctx, ctx[1:])), ctx                  # the context shifted
    cut = _run(tmp_path / "cut", 9, "--power-cut-at", "3", code=-signal.SIGKILL)
    assert _steps(cut) == {k: twin[k] for k in range(4)}
    resumed = _run(tmp_path / "cut", 5)
    assert "restored epoch 4 at step 4" in resumed and _steps(resumed) == {k: twin[k] for k in range(4, 9)}

    # a kill from outside, at a random step's line: capsules are queued (wait=False), so the
    # resume may repeat a step or two, and must repeat it exactly
    kill_after = random.Random().randint(1, 6)
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--store", str(tmp_path / "rand"), "--steps",
                             "9", *AGENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {kill_after:3d}"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (kill_after, proc.stderr.read())
    before = _steps("".join(seen))
    assert before == {k: twin[k] for k in range(kill_after + 1)}
    again = _run(tmp_path / "rand", 9)
    start = int(re.search(r"restored epoch \d+ at step (\d+)", again)[1])
    assert start <= kill_after + 1
    assert {k: r for k, r in _steps(again).items() if k < 9} == {k: twin[k] for k in range(start, 9)}, kill_after


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
