"""capsule.sdnotify and the robot app under systemd's protocol (issue 16): READY=1 after the
restore, WATCHDOG=1 from the loop, and SIGTERM ends with a final capsule the next start restores."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsule.sdnotify import notify, watchdog_interval

CONTROL = Path(__file__).resolve().parents[1] / "examples" / "robot_control.py"


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    yield str(path), sock
    sock.close()


def test_notify_sends_a_datagram_and_is_a_no_op_outside_systemd(notify_socket, monkeypatch):
    path, sock = notify_socket
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("READY=1\nSTATUS=ok") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=ok"
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert notify("READY=1") is False


def test_watchdog_interval_is_half_of_watchdogsec_for_this_process(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")               # meant for another process
    assert watchdog_interval() is None


def test_the_robot_app_speaks_systemd_and_stops_with_a_final_capsule(notify_socket, tmp_path):
    path, sock = notify_socket
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}   # a ping every 0.1 s
    argv = [sys.executable, str(CONTROL), "--store", str(tmp_path / "arm"), "--steps", "0", "--device", "cpu"]

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(argv, env={**env, "WATCHDOG_PID": ""}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        return proc

    proc = start()
    got = []
    try:
        while not any(m.startswith(b"WATCHDOG=1") for m in got[1:]) or len(got) < 3:
            got.append(sock.recv(4096))
        assert got[0].startswith(b"READY=1") and b"STATUS=at tick 0" in got[0]
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "stopped" in out
    ticks = int(re.search(r"ticks 0\.\.(\d+):", out)[1]) + 1
    sock.setblocking(False)                              # what the first run sent last
    try:
        while True:
            sock.recv(4096)
    except BlockingIOError:
        sock.settimeout(60)
    proc = start()                                       # the next boot: restored at the last tick
    try:
        msg = sock.recv(4096)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert msg.startswith(b"READY=1") and f"STATUS=at tick {ticks}".encode() in msg, (msg, out)
    assert f"at tick {ticks}" in out
