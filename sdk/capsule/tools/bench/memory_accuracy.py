"""Answer accuracy with facts injected vs prefilled: the "accuracy" section of `capsule bench --suite memory`.

Every fact of the QA set (bench/memory_qa.py: targets and distractors) is remembered once per
encoding, in its own Session: "injected w=0" encodes each fact alone, "injected w=W" after
the last W tokens of the conversation filler it was said in (MemoryConfig.window), "injected
prefix" after the system text every question starts with (APE's shared prefix), injected with
MemoryConfig.temperature PREFIX_TEMPERATURE. Then per k and question, on fresh streams, interleaved:
- injected: generate(memory_k=k) on system + question: the Session's recall (BM25 fused with
  MiniLM when installed) picks the k facts, their K/V is injected into the memory region,
  the best-ranked last (right before the question);
- prefilled: Session.recall(question turn, k) (the same retrieval: the same k facts, checked),
  their text prefilled between the system text and the question: "prefilled" best-ranked
  first (as a retrieval prompt usually lists them), "prefilled best-last" in the region's order.
So the modes differ only in how the same facts reach the model. A question whose target fact
was not retrieved counts as wrong in every mode (retrieval hit rate reported apart). The
targets compare each injected mode with the better of the two prefilled orders.
TTFT: wall time to the first token (memory_ttft's measure), recall included in both modes.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from ...memory.embedder import load_embedder
from ...session import Session
from . import BenchOptions
from .memory_qa import QASet, score
from .timing import make_clock, percentile

KS, QUICK_KS = (1, 10, 50), (1, 10)
QUESTIONS, QUICK_QUESTIONS = 200, 20
WINDOW = 32                                      # context-window encoding: tokens of filler before a fact
PREFIX_TEMPERATURE = 0.7                         # MemoryConfig.temperature of the shared-prefix mode
RANK_DECAY = 0.1                                 # MemoryConfig.rank_decay of the ranked mode
PREFIX_MODE = f"injected prefix T={PREFIX_TEMPERATURE}"
RANKED_MODE = f"{PREFIX_MODE} rank decay {RANK_DECAY}"
PREFILLED = {"prefilled": "rank", "prefilled best-last": "region"}   # mode -> the facts' order
MAX_NEW_TOKENS, STOP = 16, "\n"
MAX_FACT_TOKENS, KV_POOL_MB, MAX_CONTEXT = 32, 256, 4096
TARGET_POINTS, TARGET_RATIO = 3.0, 5.0           # injected within 3 points of prefilled at k=50, TTFT >= 5x lower
INSTRUCTION = "Answer the question with the place named in these facts."


def prompt_parts(question: str) -> tuple[str, str]:
    """(system text the facts follow, the user's turn after them): the one place the prompt
    format lives. Plain text in every mode, the same for all of them: SmolLM2's chat format was
    tried on 20 questions and answered no better (k=10: 0 injected)."""
    return f"{INSTRUCTION}\nFacts:\n", f"Question: {question}\nAnswer:"


def _answer(s: Session, name: str, k: int, clock: Callable[[], float]) -> tuple[float, str]:
    """(seconds to the first token, the whole greedy answer) of a prepared stream."""
    t0 = clock()
    first = s.generate(1, stream=name, memory_k=k, stop=STOP)
    dt = clock() - t0
    ended = s.tokens(name)[-1] in s.tokenizer.eos_ids or STOP in first
    rest = "" if ended else s.generate(MAX_NEW_TOKENS - 1, stream=name, stop=STOP)
    return dt, (first + rest).strip()


class _Run:
    """One mode's Session and its measurements."""

    def __init__(self, s: Session, texts: dict[int, str], clock: Callable[[], float]):
        self.s, self.texts, self.clock, self.n = s, texts, clock, 0

    def fresh(self, system: str, text: str) -> str:
        self.n += 1
        name = f"acc-{self.n}"
        self.s.append(system, stream=name, system=True)
        self.s.append(text, stream=name)
        return name

    def injected(self, system: str, turn: str, k: int) -> tuple[float, str, list[str], int]:
        name = self.fresh(system, turn)
        dt, ans = _answer(self.s, name, k, self.clock)
        st = self.s.engine.streams[name]
        chosen = [self.texts[f] for f in st.region.fact_ids] if st.region else []
        n_tok = len(self.s.tokens(name))
        self.s.drop_stream(name)
        return dt, ans, chosen, n_tok

    def prefilled(self, system: str, turn: str, k: int, order: str) -> tuple[float, str, list[str], int]:
        """order "rank": best-ranked first; "region": best last, as the memory region holds them.
        The chosen facts are returned in the region's order either way (the same-facts check)."""
        t0 = self.clock()
        ranked = [f.text for f in self.s.recall(turn, k)]   # the query generate(memory_k) uses
        t_recall = self.clock() - t0
        chosen = ranked[::-1]                               # the region's order: the best last
        name = self.fresh(system, "".join(chosen if order == "region" else ranked) + turn)
        dt, ans = _answer(self.s, name, 0, self.clock)
        n_tok = len(self.s.tokens(name))
        self.s.drop_stream(name)
        return t_recall + dt, ans, chosen, n_tok


def _open(path: Path, opts: BenchOptions, window: int, embedder: str | None, region: int,
          temperature: float = 1.0, rank_decay: float = 0.0) -> Session:
    return Session.open(path, model=opts.model, device=opts.device, restore=False,
                        runtime={"kv_pool_mb": KV_POOL_MB, "max_context": MAX_CONTEXT},
                        memory={"region_tokens": region, "window": window, "embedder": embedder,
                                "max_fact_tokens": min(MAX_FACT_TOKENS, region),
                                "temperature": temperature, "rank_decay": rank_decay})


@dataclass(frozen=True)
class Encoding:
    """How an injected mode's facts are remembered and injected: its store, MemoryConfig
    window, temperature and rank decay, and what each fact is encoded after (its filler, or
    the system text). Each mode has its own store: a Session holds its store alone."""
    store: str
    window: int
    temperature: float
    after_system: bool
    after: str            # for the report
    rank_decay: float = 0.0


ENCODINGS = {"injected w=0": Encoding("w0", 0, 1.0, False, "nothing"),
             f"injected w={WINDOW}": Encoding(f"w{WINDOW}", WINDOW, 1.0, False, "its filler"),
             PREFIX_MODE: Encoding("prefix", WINDOW, PREFIX_TEMPERATURE, True, "the system text"),
             RANKED_MODE: Encoding("ranked", WINDOW, PREFIX_TEMPERATURE, True, "the system text", RANK_DECAY)}


def region_for(k: int, longest: int, block: int = 16) -> int:
    """The positions k of the longest facts take, block-rounded: a tight region keeps the
    question as close to the facts as a prefill would (a loose one leaves a hole between)."""
    return -(-k * longest // block) * block


def accuracy_rows(tmp: Path, opts: BenchOptions, qa: QASet, ks: Sequence[int],
                  say: Callable[[str], None]) -> dict[str, Any]:
    """Per (mode, k): accuracy, verdicts, retrieval hit rate, TTFT p50; plus the side-by-side table.

    Each window's facts are remembered once (their store is reopened per k with a region sized
    for k facts: MemoryConfig is per Session)."""
    emb = load_embedder("auto")
    spec = None if emb is None else "auto"
    system, _ = prompt_parts("")
    longest = 1
    for enc in ENCODINGS.values():
        with _open(tmp / f"accuracy-{enc.store}", opts, enc.window, spec, MAX_FACT_TOKENS) as s:
            for text, ctx in qa.facts():
                s.remember(text, context=system if enc.after_system else ctx)
            longest = max(longest, max(f.n_tokens for f in s.memory.store.facts()))
    say(f"accuracy: {len(qa.facts())} facts remembered per encoding {list(ENCODINGS)}; longest {longest} tokens")
    rows, examples, same = [], [], 0
    for k in ks:
        region = region_for(k, longest)
        sessions = [_open(tmp / f"accuracy-{enc.store}", opts, enc.window, spec, region, enc.temperature,
                          enc.rank_decay) for enc in ENCODINGS.values()]
        try:
            runs = [_Run(s, {f.id: f.text for f in s.memory.store.facts()},
                         make_clock(s.engine.pool.tensor.device)) for s in sessions]
            modes = {**{m: runs[0] for m in PREFILLED}, **dict(zip(ENCODINGS, runs))}
            r, ex, n_same = _measure(qa, k, modes, say)
        finally:
            for s in sessions:
                s.close()
        rows += [dict(row, region_tokens=region) for row in r]
        examples += ex
        same += n_same
    return {"rows": rows, "side_by_side": side_by_side(rows), "targets": targets(rows),
            "examples": examples, "same_facts_all_modes": same / (len(ks) * len(qa.items)),
            "embedder": emb.name if emb else None, "longest_fact_tokens": longest,
            "chat_template_used": False}


def _measure(qa: QASet, k: int, modes: dict[str, _Run], say: Callable[[str], None]
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """(one row per mode, the first 3 questions' answers, questions whose k facts were the same in
    every mode)."""
    got: dict[str, list[tuple[float, str, bool, int]]] = {m: [] for m in modes}
    examples, same = [], 0
    for qi, item in enumerate((qa.items[0],) + qa.items):          # the first pass is a warm-up
        system, turn = prompt_parts(item.question)
        chosen_by = []
        for mode, run in modes.items():                             # interleaved: the same load
            dt, ans, chosen, n_tok = (run.prefilled(system, turn, k, PREFILLED[mode]) if mode in PREFILLED
                                      else run.injected(system, turn, k))
            chosen_by.append(tuple(chosen))
            hit = item.fact in chosen
            if qi:
                got[mode].append((dt, score(ans, item.place) if hit else "not_retrieved", hit, n_tok))
                if qi <= 3:
                    examples.append({"k": k, "mode": mode, "question": item.question,
                                     "place": item.place, "answer": ans, "retrieved": hit})
        same += int(qi > 0 and len(set(chosen_by)) == 1)
        if qi and qi % 50 == 0:
            say(f"accuracy k={k}: {qi}/{len(qa.items)} questions")
    rows = []
    for mode, res in got.items():
        verdicts = Counter(v for _, v, _, _ in res)
        n, hits = len(res), sum(h for _, _, h, _ in res)
        rows.append({"mode": mode, "k": k, "questions": n, "accuracy": verdicts["correct"] / n,
                     "retrieval_hit_rate": hits / n,
                     "accuracy_when_retrieved": verdicts["correct"] / hits if hits else None,
                     "wrong_place": verdicts["wrong_place"], "other_place_too": verdicts["other_too"],
                     "no_place": verdicts["no_place"], "not_retrieved": verdicts["not_retrieved"],
                     "ttft_p50_ms": percentile([d for d, _, _, _ in res], 50) * 1e3,
                     "stream_tokens_mean": statistics.mean(t for _, _, _, t in res)})
        say(f"accuracy k={k} {mode}: {rows[-1]['accuracy']:.3f} (hit {hits / n:.3f}), "
            f"TTFT p50 {rows[-1]['ttft_p50_ms']:.1f} ms")
    return rows, examples, same


def side_by_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per k: each mode's accuracy and TTFT p50 next to each other."""
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        row = out.setdefault(r["k"], {"k": r["k"], "questions": r["questions"],
                                      "retrieval_hit_rate": r["retrieval_hit_rate"]})
        row[f"{r['mode']} acc"] = r["accuracy"]
        row[f"{r['mode']} TTFT ms"] = r["ttft_p50_ms"]
    return list(out.values())


def targets(rows: list[dict[str, Any]], k: int = 50) -> list[dict[str, Any]]:
    """Each injected mode at k against the better prefilled order (the stronger text baseline)."""
    by = {(r["mode"], r["k"]): r for r in rows}
    pres = [by[(m, k)] for m in PREFILLED if (m, k) in by]
    pre, out = max(pres, key=lambda r: r["accuracy"]) if pres else None, []
    if pre is None:
        return [{"target": f"k={k}: injected within {TARGET_POINTS:.0f} points of prefilled, TTFT >= "
                           f"{TARGET_RATIO:.0f}x lower", "measured": f"not run (no k={k})", "met": "n/a"}]
    for (mode, kk), r in by.items():
        if kk != k or mode in PREFILLED:
            continue
        gap = (pre["accuracy"] - r["accuracy"]) * 100
        ratio = pre["ttft_p50_ms"] / r["ttft_p50_ms"]
        out.append({"target": f"k={k} {mode}: accuracy within {TARGET_POINTS:.0f} points of prefilled",
                    "measured": f"{r['accuracy']:.1%} vs {pre['accuracy']:.1%} {pre['mode']} "
                                f"({gap:+.1f} points behind)",
                    "met": "yes" if gap <= TARGET_POINTS else "NO"})
        out.append({"target": f"k={k} {mode}: TTFT >= {TARGET_RATIO:.0f}x lower than prefilled",
                    "measured": f"{r['ttft_p50_ms']:.1f} vs {pre['ttft_p50_ms']:.1f} ms {pre['mode']} "
                                f"({ratio:.1f}x)",
                    "met": "yes" if ratio >= TARGET_RATIO else "NO"})
    return out


SKIPPED = ("needs a trained model: answers of random weights mean nothing (builtin presets are "
           "untrained); run with --model <checkpoint folder>, or --quick for a smoke run")


def accuracy_section(tmp: Path, opts: BenchOptions, untrained: bool, say: Callable[[str], None]
                     ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]], str]:
    """(results, tables, how it was measured) of the memory suite's accuracy section. A full run
    on an untrained model is skipped (reported as such); --quick always runs a small subset."""
    if untrained and not opts.quick:
        say("accuracy: skipped (untrained model)")
        return {"skipped": SKIPPED}, {"answer accuracy": [{"section": "accuracy", "skipped": SKIPPED}]}, SKIPPED
    from .memory_qa import build_qa                 # reads the chitchat corpus: only when it runs

    n, ks = (QUICK_QUESTIONS, QUICK_KS) if opts.quick else (QUESTIONS, KS)
    qa = build_qa(n, seed=0)
    res = accuracy_rows(tmp, opts, qa, ks, say)
    system, turn = prompt_parts("Where is the amber wrench?")
    how = (f"{n} questions (seeded QA set, bench/memory_qa.py: {len(qa.items)} (object, place) facts, "
           f"{len(qa.distractors)} distractor facts naming an object but no place; each fact said after "
           "4 lines of the Chit-Chat corpus), k = " + ", ".join(map(str, ks)) + "; modes on fresh streams, "
           "interleaved per question: prefilled = Session.recall(turn, k) then the k facts' text prefilled "
           "between system and question, best-ranked first (prefilled) or last (prefilled best-last); "
           "injected = generate(memory_k=k) on system + question, each fact's K/V encoded after "
           + "; ".join(f"{enc.after} ({m})" for m, enc in ENCODINGS.items())
           + f", injected against the region's end, the best-ranked last; {PREFIX_MODE}: keys scaled by "
           f"1/{PREFIX_TEMPERATURE} (MemoryConfig.temperature); {RANKED_MODE}: the same, and the keys of the "
           f"fact ranked r-th (0: the best) by a further 1/(1 + {RANK_DECAY} r) (MemoryConfig.rank_decay); "
           "the same k facts in every mode "
           "(same_facts_all_modes); greedy, up to "
           f"{MAX_NEW_TOKENS} tokens, stop at a newline; correct = the answer names the right place and "
           "no other; a question whose fact was not retrieved is wrong in every mode; TTFT p50 = "
           "wall time to the first token, recall included in every mode; region = k x the longest "
           f"fact, block-rounded; prompt: {system!r} + facts + {turn!r} (plain text, no chat template); "
           "targets: each injected mode against the better prefilled order")
    tables = {"answer accuracy: prefilled vs injected, side by side": res["side_by_side"],
              "answer accuracy per mode": res["rows"], "answer accuracy targets": res["targets"]}
    return res, tables, how
