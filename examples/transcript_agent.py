"""A robot's transcript growing by small appends for hundreds of turns: the exact incremental
tokenizer re-encodes a window around each seam, where a plain tokenizer re-encodes everything.

Each turn appends a short log line or reply (tens of characters) to one long text. Per turn it
times ``IncrementalTokenizer.append`` against ``reference.encode(full text)``, checks that both
give the same ids (every --check turns, and at the end), and prints the time per turn as the
transcript grows.

    python examples/transcript_agent.py --turns 600 --tokenizer cl100k_base
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from capsule.tokenize import IncrementalTokenizer

LINES = ("joint{j} at {v:.3f} rad, torque {t:.2f} Nm\n", "user: bring the {o} to the {p}\n",
         "assistant: moving the {o} to the {p} now.\n", "camera: {o} seen at ({x}, {y}) px\n",
         "battery {b}%  temp {c:.1f} C\n")
OBJECTS = ("red cup", "charger", "blue box", "sponge", "tablet")
PLACES = ("kitchen", "hallway", "table", "shelf", "sink")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--turns", type=int, default=600, help="appends to make")
    ap.add_argument("--tokenizer", default="cl100k_base",
                    help="a family name (cl100k_base, qwen2.5, ...), a tokenizer.json or a .tiktoken path")
    ap.add_argument("--check", type=int, default=50, metavar="N",
                    help="compare the incremental ids with a full encode every N turns")
    ap.add_argument("--report", type=int, default=100, metavar="N", help="print a line every N turns")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated transcript")
    return ap.parse_args()


def line(rng: random.Random) -> str:
    return rng.choice(LINES).format(j=rng.randrange(6), v=rng.uniform(-3, 3), t=rng.uniform(0, 9),
                                    o=rng.choice(OBJECTS), p=rng.choice(PLACES), x=rng.randrange(640),
                                    y=rng.randrange(480), b=rng.randrange(100), c=rng.uniform(20, 60))


def main() -> None:
    args = parse_args()
    if min(args.turns, args.check, args.report) < 1:
        raise SystemExit("--turns, --check and --report must be >= 1")
    tok = IncrementalTokenizer.from_family(args.tokenizer, shadow_rate=0.0)
    ref = tok.reference
    print(f"tokenizer {ref.name}: {'full re-encoding (no splice rule: ' + str(tok.full_reason) + ')' if tok.full_mode else 'windowed'}")
    rng = random.Random(args.seed)
    text, inc_ms, full_ms = "", [], []
    print(f"{'turn':>6} {'chars':>8} {'tokens':>7} {'append ms':>10} {'full ms':>8} {'x faster':>9}")
    for turn in range(1, args.turns + 1):
        piece = line(rng)
        text += piece
        t0 = time.perf_counter()
        tok.append(piece)
        t1 = time.perf_counter()
        full = ref.encode(text)
        t2 = time.perf_counter()
        inc_ms.append((t1 - t0) * 1e3)
        full_ms.append((t2 - t1) * 1e3)
        if turn % args.check == 0 or turn == args.turns:
            if tok.ids != full:
                raise SystemExit(f"turn {turn}: incremental ids differ from the full encode")
        if turn % args.report == 0 or turn == args.turns:
            a = statistics.median(inc_ms[-args.report:])
            f = statistics.median(full_ms[-args.report:])
            print(f"{turn:>6} {len(text):>8} {len(full):>7} {a:>10.3f} {f:>8.3f} {f / a:>9.1f}")
    print(f"ids equal the full encode at every check; median per turn over all {args.turns}: "
          f"append {statistics.median(inc_ms):.3f} ms, full {statistics.median(full_ms):.3f} ms")


if __name__ == "__main__":
    main()
