"""`capsule demo`: a short end-to-end run that shows the Session and what each part costs here."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..session import Session

TRANSCRIPT = ("system: you are the planner of a mobile manipulator.\n"
              "user: bring me the red cup from the kitchen table\n"
              "robot: navigating to kitchen table (3.2 m)\n"
              "robot: red cup detected at x=0.41 y=-0.12, grasp planned\n"
              "user: careful, it is fragile\n"
              "robot:")
SECOND_STREAM = "user: what is the battery level?\nrobot:"
# the same conversation as chat turns, for a model with a chat template (the trained default)
SYSTEM = ("You are Robo, a home robot with wheels and two arms. When the user asks for something, "
          "reply with one sentence that says which action you take.")
TURN = "Please bring me the red cup from the kitchen table."
SECOND_TURN = "What is your battery level?"
FOLLOW_UP = "Careful, it is fragile. How will you grasp it?"
NEW_TOKENS = 24


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


FACTS = ("The red cup is fragile.", "The charger is in bay 2.", "The kitchen table is 3.2 m away.")


def _memory(s: Session, echo: Callable[[str], None]) -> None:
    """Facts encoded once (pre-RoPE K/V, durable), then injected instead of prefilled."""
    t0 = time.perf_counter()
    for fact in FACTS:
        s.remember(fact)
    echo(f"remember {_ms(time.perf_counter() - t0)}  ({len(FACTS)} facts: K/V computed once, stored)")
    if _chat(s):
        s.chat("system", SYSTEM, stream="ask")   # the facts' region sits right after it
    _say(s, "Where do I charge you?", "user: where do I charge you?\nrobot:", "ask")
    t0 = time.perf_counter()
    first = s.generate(1, stream="ask", memory_k=2)
    took = time.perf_counter() - t0
    injected = [f.text for f in s.recall("where do I charge you?", k=2)]
    echo(f"memory   {_ms(took)}  (first token with 2 facts' K/V injected, not prefilled: {injected})")
    echo(f"answer   {(first + s.generate(NEW_TOKENS, stream='ask')).strip()[:96]!r}")


def _chat(s: Session) -> bool:
    return s.model_info is not None and s.model_info.chat_template is not None


def _say(s: Session, turn: str, transcript: str, stream: str = "main") -> None:
    """A user turn: through the model's chat template when it has one, else as transcript text."""
    if _chat(s):
        s.chat("user", turn, stream=stream)
    else:
        s.append(transcript, stream=stream)


def _control(path: Path, device: str, echo: Callable[[str], None]) -> None:
    """A policy in a 100 Hz control loop with a capsule every 10 ticks."""
    import numpy as np

    from ..control import ControlLoop
    with Session.open(path, model=None, policy="builtin:gru", device=device) as s:
        obs = {"observation.state": np.zeros(14, dtype=np.float32)}
        st = ControlLoop(s, hz=100, checkpoint_every=10).run(lambda tick: s.act(obs), steps=100)
        echo(f"control  100 Hz x {st.steps} ticks, policy builtin:gru on {s.policy_engine}: "
             f"step p50/p99 {st.step_p50_ms:.2f}/{st.step_p99_ms:.2f} ms, {st.misses} misses, "
             f"{st.checkpoints} capsules (stall p99 {st.checkpoint_stall_p99_ms:.2f} ms)")


def run_demo(*, model: str = "smollm2-135m", tokenizer: str | None = None, device: str = "auto",
             store: str | None = None, echo: Callable[[str], None] = print) -> None:
    """Open a Session, append, generate one stream then two together, remember and inject facts,
    take a capsule and restore it in a fresh Session, run a policy in a 100 Hz loop; print what
    each step took.

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
            tok = "its own" if s.tokenizer.name.startswith("file:") else s.tokenizer.name
            echo(f"model    {model}: {s.model_info.label or model}, tokenizer {tok}")
            if getattr(s.model_info, "untrained", False):
                echo("note     builtin models are seeded random UNTRAINED weights: the text below is gibberish;"
                     " the timings are real")
            echo(f"open     {_ms(t_open)}  (store {path}{'' if store else ', temporary: deleted afterwards'})")

            t0 = time.perf_counter()
            if _chat(s):   # the model's own chat template formats the turns
                s.chat("system", SYSTEM)
                s.chat("user", TURN)
            else:
                s.append(TRANSCRIPT)
            echo(f"append   {_ms(time.perf_counter() - t0)}  ({len(s.tokens())} tokens, exact tokenization"
                 f"{', chat template' if _chat(s) else ''})")

            t0 = time.perf_counter()
            first = s.generate(1)  # the whole transcript is prefilled to get the first token
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            reply = first + s.generate(NEW_TOKENS - 1)
            t_decode = time.perf_counter() - t0
            echo(f"prefill  {_ms(t_prefill)}  (prompt + first token)")
            echo(f"generate {_ms(t_decode)}  ({NEW_TOKENS - 1} more tokens, greedy: "
                 f"{t_decode / (NEW_TOKENS - 1) * 1e3:.2f} ms/token decode)")
            echo(f"reply    {reply.strip()[:96]!r}")

            _say(s, SECOND_TURN, SECOND_STREAM, "status")
            _say(s, FOLLOW_UP, "\nrobot: grasping", "main")
            t0 = time.perf_counter()
            replies = s.generate(NEW_TOKENS, stream=["main", "status"])
            t_two = time.perf_counter() - t0
            echo(f"batch    {_ms(t_two)}  (2 streams x {NEW_TOKENS} tokens decoded together: "
                 f"{t_two / NEW_TOKENS * 1e3:.2f} ms/step)")
            for name, text in replies.items():
                echo(f"  {name:<7}{text.strip()[:88]!r}")
            _memory(s, echo)
            t0 = time.perf_counter()
            epoch = s.checkpoint()
            echo(f"capsule  {_ms(time.perf_counter() - t0)}  (epoch {epoch}: durable when it returns)")
        t0 = time.perf_counter()
        with Session.open(path, model=model, tokenizer=tokenizer, device=device) as s:
            t_restore = time.perf_counter() - t0
            t0 = time.perf_counter()
            s.generate(1)
            echo(f"restore  {_ms(t_restore)}  (fresh open + restore of epoch {s.restored_epoch}, "
                 f"{len(s.tokens())} tokens); first token {_ms(time.perf_counter() - t0).strip()} "
                 "without re-prefilling")
        _control(path.parent / "arm.capsules", device, echo)
        if store:
            echo(f"store kept at {path}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
