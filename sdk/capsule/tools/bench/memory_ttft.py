"""Time to first token with k facts injected vs prefilled: part of `capsule bench --suite memory`.

Every measured call is generate(1) on a fresh stream (system + text), so the region is reserved
and filled in each: injected = generate(1, memory_k=k) on system + question; prefilled =
generate(1) on system + the same k facts' text in the same order + question.

Two protocols, because what runs just before a rep matters on a small CPU (a 1,500-token prefill
evicts the facts' host K/V and the weights from cache):
- per k, injected and prefilled reps interleaved (the ratio: both paths see the same load);
- injected reps at the smallest and largest k alternated (the growth: both see the same
  preceding work; in the first protocol a k = 50 rep follows a 1,500-token prefill rep, a
  k = 1 rep an 88-token one).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from ...session import Session


def drop(s: Session, name: str) -> None:
    """Bench-only: free a measured stream's KV blocks (Session has no stream delete)."""
    st = s.engine.streams.pop(name)
    s.engine.pool.release(st.table.blocks)


def fresh(s: Session, name: str, system: str, text: str) -> str:
    s.append(system, stream=name, system=True)
    s.append(text, stream=name)
    return name


class _Timer:
    """generate(1) on fresh streams: (seconds, stream tokens, injected fact ids) per call."""

    def __init__(self, s: Session, system: str, clock: Callable[[], float]):
        self.s, self.system, self.clock, self.n = s, system, clock, 0

    def __call__(self, text: str, k: int) -> tuple[float, int, tuple[int, ...]]:
        self.n += 1
        name = fresh(self.s, f"ttft-{self.n}", self.system, text)
        t0 = self.clock()
        self.s.generate(1, stream=name, memory_k=k)
        dt = self.clock() - t0
        st = self.s.engine.streams[name]
        out = (dt, len(st.ids), st.region.fact_ids if st.region else ())
        drop(self.s, name)
        return out


def ttft_rows(s: Session, facts: Sequence[str], ks: Sequence[int], reps: int, system: str, question: str,
              clock: Callable[[], float], say: Callable[[str], None]) -> tuple[list[dict], dict]:
    """(one row per k, the growth measurement); facts are remembered here (host-cached)."""
    texts = {s.remember(t): t for t in facts}
    tok, rows, timed = s.tokenizer, [], _Timer(s, system, clock)
    for k in ks:
        _, _, chosen = timed(question, k)                # warm-up; says which k facts recall picks
        joint = "".join(texts[f] for f in chosen) + question   # the same facts, same order, as text
        timed(joint, 0)                                  # warm-up
        injected, prefilled = [], []
        for _ in range(reps):                            # interleaved: both see the same machine load
            injected.append(timed(question, k))
            prefilled.append(timed(joint, 0))
        if len(chosen) != k or any(c != chosen for _, _, c in injected):
            raise RuntimeError(f"k={k}: injected facts {chosen} differ between reps or are not {k}")
        inj, pre = statistics.median(d for d, _, _ in injected), statistics.median(d for d, _, _ in prefilled)
        rows.append({"k": k, "fact_tokens": sum(len(tok.encode(texts[f])) for f in chosen),
                     "injected_ttft_ms": inj * 1e3, "prefill_ttft_ms": pre * 1e3,
                     "injected_min_max_ms": f"{min(d for d, _, _ in injected) * 1e3:.1f}-"
                                            f"{max(d for d, _, _ in injected) * 1e3:.1f}",
                     "injected_stream_tokens": injected[0][1], "prefill_stream_tokens": prefilled[0][1],
                     "ratio_prefill_over_injected": pre / inj})
        say(f"TTFT k={k}: injected {inj * 1e3:.1f} ms, prefilled {pre * 1e3:.1f} ms ({pre / inj:.1f}x)")
    lo, hi = min(ks), max(ks)
    alternated: dict[int, list[float]] = {lo: [], hi: []}
    for _ in range(reps):
        for k in (lo, hi):
            alternated[k].append(timed(question, k)[0])
    a, b = statistics.median(alternated[lo]) * 1e3, statistics.median(alternated[hi]) * 1e3
    growth = {"k_low": lo, "k_high": hi, "reps": reps, "low_ms": a, "high_ms": b, "growth": b / a}
    say(f"TTFT growth k={lo} -> k={hi}, injected reps alternated: {a:.1f} -> {b:.1f} ms ({b / a:.2f}x)")
    return rows, growth


def targets(rows: list[dict[str, Any]], growth: dict[str, Any], ratio: float,
            max_growth: float) -> list[dict[str, Any]]:
    by, out = {r["k"]: r for r in rows}, []
    if 50 in by:
        v = by[50]["ratio_prefill_over_injected"]
        out.append({"target": f"k=50: injected TTFT >= {ratio:.0f}x lower than prefill",
                    "measured": f"{v:.1f}x", "met": "yes" if v >= ratio else "NO"})
    if (growth["k_low"], growth["k_high"]) == (1, 50):
        g = growth["growth"]
        out.append({"target": f"injected TTFT growth k=1 -> k=50 <= {max_growth}x",
                    "measured": f"{growth['low_ms']:.1f} -> {growth['high_ms']:.1f} ms ({g:.2f}x; reps "
                                "alternated)", "met": "yes" if g <= max_growth else "NO"})
        t = by[50]["injected_ttft_ms"] / by[1]["injected_ttft_ms"]
        out.append({"target": "(the same from the TTFT table, each rep after a prefill rep of its k)",
                    "measured": f"{by[1]['injected_ttft_ms']:.1f} -> {by[50]['injected_ttft_ms']:.1f} ms "
                                f"({t:.2f}x)", "met": "info"})
    return out
