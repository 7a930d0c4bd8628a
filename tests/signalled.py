"""A child process signalled once it has shown it is under way: the shared half of the tests that
check how an app or a bench ends on Ctrl-C / SIGTERM."""
from __future__ import annotations

import subprocess
import time
from typing import Mapping, Sequence


def signal_after_line(argv: Sequence[str], prefix: str, sig: int, *, delay_s: float = 1.0,
                      stream: str = "stdout", env: Mapping[str, str] | None = None,
                      timeout_s: float = 120) -> tuple[int, str, str]:
    """Start argv, wait for a line of ``stream`` that starts with prefix, let it run delay_s more,
    send sig, and return (returncode, stdout, stderr) of the rest of its run (killed on a timeout)."""
    proc = subprocess.Popen(list(argv), env=None if env is None else dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in getattr(proc, stream):
            if line.startswith(prefix):
                break
        time.sleep(delay_s)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    return proc.returncode, out, err
