"""systemd's service notifications (sd_notify), for a robot app run as a Type=notify unit.

``notify("READY=1")`` once the Session has opened (its capsule restored), ``notify("WATCHDOG=1")``
at least every ``watchdog_interval()`` seconds while the loop is healthy, ``notify("STOPPING=1")``
when it begins its final capsule. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op that
returns False. A datagram to a unix socket, as the protocol asks: no dependency, never blocks the
control loop (a full socket drops the message and returns False).
"""
from __future__ import annotations

import os
import socket

__all__ = ["notify", "watchdog_interval"]


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to systemd; True when it was sent."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where or not isinstance(state, str) or not state:
        return False
    if where.startswith("@"):        # an abstract socket: a leading NUL instead of the @
        where = "\0" + where[1:]
    elif not where.startswith("/"):
        return False                 # not a unix socket path (vsock is not handled here)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode(), where)
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings: half of systemd's WatchdogSec= for this process, or
    None when no watchdog is set (or it is set for another process)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
