"""A 100 Hz control loop whose policy state survives power cuts.

The policy (builtin:gru: seeded random weights, untrained) runs through the fastest engine the
device profile allows; its hidden state and action queue are capsule state, and a capsule is
staged every 10 ticks without blocking the loop (disk I/O runs on the writer thread). Kill it
and run it again: it continues the same episode from its last capsule.

    python examples/robot_control.py --store /tmp/arm.capsules --steps 200

Run by systemd (packaging/jetson/capsule-robot.service, Type=notify) it says READY=1 once its
capsule is restored, pings the watchdog from the loop, and on SIGTERM (systemctl stop) ends
after the step in progress with a final capsule, as on Ctrl-C.
"""
from __future__ import annotations

import argparse
import signal
import time

import numpy as np

from capsule import ControlLoop, Session
from capsule.sdnotify import notify, watchdog_interval


EVERY = 10   # a capsule every EVERY ticks


def observation(tick: int) -> dict:
    # a stand-in for joint encoders: a slow sine per joint
    q = np.sin(0.01 * tick + np.arange(14, dtype=np.float32)).astype(np.float32)
    return {"observation.state": q}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--store", default="arm.capsules",
                    help="capsule store folder (created if missing; a rerun continues from its last capsule)")
    ap.add_argument("--steps", type=int, default=200,
                    help="control ticks to run in this process (0: until SIGINT / SIGTERM)")
    ap.add_argument("--hz", type=float, default=100.0, help="control rate of the loop")
    ap.add_argument("--policy", default="builtin:gru",
                    help="an .onnx policy file or builtin:mlp | builtin:mlp-chunk | builtin:gru")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name")
    args = ap.parse_args()

    with Session.open(args.store, model=None, policy=args.policy, device=args.device) as s:
        if s.restored_epoch is None:
            s.state = {"tick": 0}
            print(f"fresh episode (engine {s.policy_engine})")
        else:
            print(f"restored epoch {s.restored_epoch} at tick {s.state['tick']} (engine {s.policy_engine})")
        start = s.state["tick"]
        last = {}
        ping = watchdog_interval()          # None outside systemd or without WatchdogSec=
        due = [time.monotonic()]
        notify(f"READY=1\nSTATUS=at tick {start}")

        def step(_slot: int) -> None:
            # count steps taken, not schedule slots: a missed deadline skips slots, not ticks
            tick = s.state["tick"]
            last["action"] = s.act(observation(tick))
            s.state = {"tick": tick + 1}     # capsule state: where the episode is
            if ping is not None and time.monotonic() >= due[0]:   # a stuck loop stops pinging
                notify("WATCHDOG=1")
                due[0] = time.monotonic() + ping

        loop = ControlLoop(s, hz=args.hz, checkpoint_every=EVERY)
        # Ctrl-C or systemctl stop ends the loop after the step in progress: a final capsule
        # below, no traceback
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: loop.stop())
        st = loop.run(step, steps=args.steps or None)
        notify("STOPPING=1")
        if args.steps == 0 or st.steps < args.steps:
            print("interrupted" if args.steps else "stopped")
        if st.steps % EVERY:                # the ticks after the loop's last capsule
            s.checkpoint()
        s.flush()
        print(f"ticks {start}..{s.state['tick'] - 1}: {st.steps} steps, {st.misses} deadline misses, "
              f"step p50/p99 {st.step_p50_ms:.3f}/{st.step_p99_ms:.3f} ms, {st.checkpoints} capsules "
              f"(stall p99 {st.checkpoint_stall_p99_ms:.3f} ms)")
        if last:
            print("last action", np.round(last["action"], 4).tolist())


if __name__ == "__main__":
    main()
