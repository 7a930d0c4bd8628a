"""An assistant that remembers facts across restarts and answers with them (memory_k).

Facts are stored once (`remember`: text, embedding and their K/V, durable in the store) and
survive restarts; a question injects the K/V of the k most relevant facts instead of prefilling
their text. It prints the answer and the time to first token both ways: facts injected, and the
same facts written into the prompt. With one short fact both take about as long (the prompt is
a few tokens longer); injection's gain grows with k and with the facts' length (docs/MEMORY.md:
7.7x faster at k = 50). SmolLM2-135M is small: its answers use the facts, not always well.

    python examples/memory_assistant.py --store /tmp/mem --remember "The charger is in the hallway."
    python examples/memory_assistant.py --store /tmp/mem --ask "Where is the charger?"
"""
from __future__ import annotations

import argparse
import time

from capsule import Session

SYSTEM = "system: you are a home robot. Answer in one short sentence using what you know.\n"
FIRST_FACTS = ("The charger is in the hallway, behind the blue door.",
               "The red cup is fragile: carry it with both hands.",
               "Anna takes her medicine at 8 pm with a glass of water.",
               "The cat must not go into the garage.")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--store", default="memory.capsules", help="capsule store folder; its facts persist")
    ap.add_argument("--remember", action="append", default=[], metavar="TEXT",
                    help="a fact to store (repeatable); a new store starts with a few household facts")
    ap.add_argument("--ask", default="Where is the charger?", help="the question to answer")
    ap.add_argument("--k", type=int, default=1, help="facts injected per question (memory_k)")
    ap.add_argument("--max-tokens", type=int, default=24, help="most tokens per answer")
    ap.add_argument("--model", default="smollm2-135m", help="a named model, a .gguf, a checkpoint folder or builtin:small")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or a device profile name")
    return ap.parse_args()


def answer(s: Session, stream: str, prompt: str, max_tokens: int, memory_k: int = 0) -> tuple[str, float]:
    """(the reply, seconds from the question to its first piece) on a fresh stream."""
    t0 = time.perf_counter()
    first: list[float] = []

    def on_token(_stream: str, _piece: str) -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    s.append(SYSTEM, stream=stream, system=True)
    s.append(prompt, stream=stream)
    reply = s.generate(max_tokens, stream=stream, stop=["\n", "user:"], memory_k=memory_k, on_token=on_token)
    s.drop_stream(stream)
    return reply.strip(), first[0] if first else time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    with Session.open(args.store, model=args.model, device=args.device) as s:
        new = list(args.remember) or ([] if s.recall("home", k=1) else list(FIRST_FACTS))
        for text in new:
            print(f"remembered #{s.remember(text)}: {text}")
        answer(s, "warm-up", "user: hello\nassistant:", 2)   # first-call costs (the encoder) apart
        question = f"user: {args.ask}\nassistant:"
        facts = [f.text for f in s.recall(args.ask, k=args.k)]
        print(f"question: {args.ask}\nmost relevant facts: {facts}")
        injected, t_inject = answer(s, "ask-injected", question, args.max_tokens, memory_k=args.k)
        written = "".join(f"fact: {t}\n" for t in facts)
        prefilled, t_prefill = answer(s, "ask-prefilled", written + question, args.max_tokens)
        print(f"answer (facts injected):  {injected!r}  TTFT {t_inject * 1e3:.0f} ms")
        print(f"answer (facts in prompt): {prefilled!r}  TTFT {t_prefill * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
