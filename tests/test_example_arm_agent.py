"""examples/arm_agent.py (issue 16): the simulated SO-101 survives a SIGKILL mid-episode, and the
resumed run ends with exactly the trajectory hash of a run that never stopped (the planner's
K/V, the policy's buffers and MuJoCo's state all come back bit-exactly)."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from signalled import signal_after_line

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arm_agent.py"
HASH = re.compile(r"^trajectory sha256: ([0-9a-f]{64})$", re.M)
ARGS = ["--steps", "50", "--checkpoint-every", "10", "--device", "cpu", "--hz", "100"]


def _run(store: Path, *extra: str, code: int = 0) -> str:
    res = subprocess.run([sys.executable, str(EXAMPLE), "--store", str(store), *ARGS, *extra],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == code, res.stdout + res.stderr
    return res.stdout


def test_a_power_cut_resumes_to_the_same_trajectory(tmp_path):
    whole = _run(tmp_path / "a")
    assert "trained the reach policy" in whole and "fresh episode" in whole
    want = HASH.search(whole)[1]
    assert re.search(r"reaches that grasped: [1-9]", whole), whole    # the clone does reach the cube
    # the same policy file for the second store (training again would be another policy)
    shutil.copy(tmp_path / "a.reach-policy.onnx", tmp_path / "b.reach-policy.onnx")
    cut = _run(tmp_path / "b", "--power-cut-at", "27", code=-signal.SIGKILL)
    assert "power cut at step 27" in cut and not HASH.search(cut)
    resumed = _run(tmp_path / "b")
    assert re.search(r"restored epoch \d+ at step 20 ", resumed), resumed   # the capsule before the cut
    assert HASH.search(resumed)[1] == want
    again = _run(tmp_path / "b", "--steps", "60")                # and it goes on from there
    assert "restored epoch" in again and HASH.search(again)[1] != want


def test_every_option_has_help():
    res = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    for opt in ("--store", "--steps", "--power-cut-at", "--hz", "--checkpoint-every", "--model", "--device"):
        after = text.split(f" {opt} ", 1)[1].split(" --", 1)[0]      # metavar + help, up to the next option
        assert len(after.split()) >= 4, (opt, after)                  # a sentence, not just a metavar
    assert "(default:" in text


def test_ctrl_c_ends_with_a_final_capsule_and_the_rerun_goes_on(tmp_path):
    code, out, err = signal_after_line([sys.executable, str(EXAMPLE), "--store", str(tmp_path / "c"), "--steps",
                                        "100000", "--device", "cpu", "--hz", "50"], "fresh episode", signal.SIGINT)
    assert code == 0 and "Traceback" not in err, err
    assert "interrupted" in out and HASH.search(out)
    done = int(re.search(r"steps 0\.\.(\d+) in", out)[1]) + 1
    again = _run(tmp_path / "c", "--steps", str(done + 5))
    assert f"at step {done} " in again                  # the final capsule held every step made
