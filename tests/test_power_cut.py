"""Power cut: SIGKILL a session that checkpoints every step; nothing acknowledged is lost.

A child process generates one token per step and checkpoints after each (wait=True, or
wait=False with a flush every few steps), printing each epoch once it is durable. The parent
kills it at a random moment, reopens the store, and checks that the restored epoch is at
least the last acknowledged one and that the continuation equals an uninterrupted run.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from capsule import Session

RT = {"kv_pool_mb": 8, "max_context": 1024}
PROMPT = "robot log: " + " ".join(f"joint{i}=0.{i:03d}" for i in range(80)) + "\n"
STEPS = 400

CHILD = r"""
import sys
from capsule import Session
wait, store = sys.argv[1] == "sync", sys.argv[2]
s = Session.open(store, device="cpu", runtime={"kv_pool_mb": 8, "max_context": 1024})
if s.restored_epoch is None:
    s.append(%r)
for step in range(%d):
    s.generate(1)
    s.state = {"step": step}
    e = s.checkpoint(wait=wait)
    if wait:
        print("ACK", e, flush=True)
    elif step %% 4 == 3:
        s.flush()
        print("ACK", e, flush=True)
""" % (PROMPT, STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Token lists after each step of an uninterrupted run (the same call pattern as the child)."""
    with Session.open(tmp_path_factory.mktemp("ref") / "s", device="cpu", runtime=RT) as s:
        s.append(PROMPT)
        n0 = len(s.tokens())
        for _ in range(STEPS + 4):
            s.generate(1)
        return n0, s.tokens()


def _run_and_kill(store: str, mode: str, rng: random.Random) -> int:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, store], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    acked = 0
    line = proc.stdout.readline()                 # wait until the child is really checkpointing
    if line.startswith("ACK"):
        acked = int(line.split()[1])
    time.sleep(rng.uniform(0.0, 0.4))
    os.kill(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    # only whole lines count: the kill can land inside a print, leaving "ACK" or "ACK 1" of "ACK 12"
    for line in out.splitlines(keepends=True):
        if line.startswith("ACK") and line.endswith("\n"):
            acked = int(line.split()[1])
    assert proc.returncode == -signal.SIGKILL, err
    return acked


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_never_loses_an_acknowledged_epoch(tmp_path, reference, mode):
    n0, ref = reference
    rng = random.Random(1234 if mode == "sync" else 4321)
    # 8 random kill moments per mode (tests/reliability/test_rel_kills.py and test_store_crash.py
    # kill at chosen points too): 15 took 44 s per mode of the suite's ~10 minutes
    for trial in range(8):
        store = str(tmp_path / f"t{trial}")
        acked = _run_and_kill(store, mode, rng)
        with Session.open(store, device="cpu", runtime=RT) as s:
            restored = s.restored_epoch
            assert restored is not None and restored >= acked, (trial, restored, acked)
            step = s.state["step"]
            # epoch e holds the state after step e-1: prompt + e generated tokens
            assert step == restored - 1
            assert s.tokens() == ref[: n0 + restored]
            s.generate(1)
            s.generate(1)
            assert s.tokens() == ref[: n0 + restored + 2]
