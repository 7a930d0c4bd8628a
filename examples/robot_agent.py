"""A robot agent loop that survives power cuts.

Run it, kill it (Ctrl-C, or `kill -9`), run it again: it continues from its last capsule,
with the same transcript, KV cache, sampler state and app state, without re-prefilling.

    python examples/robot_agent.py --store /tmp/agent.capsules --steps 20

The builtin model is seeded random weights (untrained): the replies are gibberish; the point is
that they continue exactly.
"""
from __future__ import annotations

import argparse
import time

from capsule import Session

TASKS = ["bring me the red cup", "open the door", "go to the charger", "put the cup in the sink"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="agent.capsules")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    t0 = time.perf_counter()
    with Session.open(args.store, model=args.model, device=args.device,
                      runtime={"kv_pool_mb": 32}) as s:
        opened_ms = (time.perf_counter() - t0) * 1e3
        if s.restored_epoch is None:
            s.append("system: you are a helpful home robot.\n")
            s.state = {"step": 0}
            print(f"fresh start (open {opened_ms:.0f} ms)")
        else:
            print(f"restored epoch {s.restored_epoch} at step {s.state['step']}, "
                  f"{len(s.tokens())} tokens in context (open + restore {opened_ms:.0f} ms)")
        for _ in range(args.steps):
            step = s.state["step"]
            s.append(f"user: {TASKS[step % len(TASKS)]}\nrobot:")
            reply = s.generate(12, temperature=0.7, seed=None if step else 1, stop="\n")
            s.append("\n")
            s.state = {"step": step + 1}
            epoch = s.checkpoint(wait=False)            # disk I/O happens off this thread
            print(f"step {step:3d} epoch {epoch:4d} reply {reply!r}")
        s.flush()


if __name__ == "__main__":
    main()
