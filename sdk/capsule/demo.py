"""`capsule demo`: a short end-to-end run that shows the Session and what each part costs here."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from .session import Session

TRANSCRIPT = ("system: you are the planner of a mobile manipulator.\n"
              "user: bring me the red cup from the kitchen table\n"
              "robot: navigating to kitchen table (3.2 m)\n"
              "robot: red cup detected at x=0.41 y=-0.12, grasp planned\n"
              "user: careful, it is fragile\n"
              "robot:")
SECOND_STREAM = "user: what is the battery level?\nrobot:"
NEW_TOKENS = 24


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def run_demo(*, model: str = "builtin:tiny", tokenizer: str | None = "cl100k_base", device: str = "auto",
             store: str | None = None, echo: Callable[[str], None] = print) -> None:
    """Open a Session, append, generate one stream then two together; print what each step took.

    Without `store` the store lives in a temporary folder that is deleted afterwards.
    """
    tmp = None if store else tempfile.mkdtemp(prefix="capsule-demo-")
    path = Path(store) if store else Path(tmp) / "demo.capsules"
    try:
        t0 = time.perf_counter()
        s = Session.open(path, model=model, tokenizer=tokenizer, device=device)
        t_open = time.perf_counter() - t0
        with s:
            rt = s.profile.runtime
            echo(f"profile  {s.profile.name}: {s.profile.device}, {rt.dtype}, batch buckets "
                 f"{list(rt.batch_buckets)}, cuda graphs {'on' if rt.cuda_graphs else 'off'}")
            echo(f"model    {model} with tokenizer {s.tokenizer.name}")
            if getattr(s.model_info, "untrained", False):
                echo("note     builtin models are seeded random UNTRAINED weights: the text below is gibberish;"
                     " the timings are real")
            echo(f"open     {_ms(t_open)}  (store {path}{'' if store else ', temporary: deleted afterwards'})")

            t0 = time.perf_counter()
            s.append(TRANSCRIPT)
            echo(f"append   {_ms(time.perf_counter() - t0)}  ({len(s.tokens())} tokens, exact tokenization)")

            t0 = time.perf_counter()
            s.generate(1)  # the whole transcript is prefilled to get the first token
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            reply = s.generate(NEW_TOKENS - 1)
            t_decode = time.perf_counter() - t0
            echo(f"prefill  {_ms(t_prefill)}  (prompt + first token)")
            echo(f"generate {_ms(t_decode)}  ({NEW_TOKENS - 1} more tokens, greedy: "
                 f"{t_decode / (NEW_TOKENS - 1) * 1e3:.2f} ms/token decode)")
            echo(f"reply    {reply[:72]!r}")

            s.append(SECOND_STREAM, stream="status")
            s.append("\nrobot: grasping", stream="main")
            t0 = time.perf_counter()
            replies = s.generate(NEW_TOKENS, stream=["main", "status"])
            t_two = time.perf_counter() - t0
            echo(f"batch    {_ms(t_two)}  (2 streams x {NEW_TOKENS} tokens decoded together: "
                 f"{t_two / NEW_TOKENS * 1e3:.2f} ms/step)")
            for name, text in replies.items():
                echo(f"  {name:<7}{text[:64]!r}")
        if store:
            echo(f"store kept at {path}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
