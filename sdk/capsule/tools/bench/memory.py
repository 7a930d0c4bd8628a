"""`capsule bench --suite memory`: fact injection vs prefill, recall latency, injection deviation.

1. TTFT with k facts: generate(1, memory_k=k) (recall + inject the facts' host-cached pre-RoPE K/V
   + prefill system and question) vs generate(1) prefilling the same facts' text; fresh streams
   (bench/memory_ttft.py).
2. Recall latency over many facts: lexical (BM25), embedding only, hybrid (Session.recall).
3. Decode step cost with no region / a 512- / 2048-position region (bench/memory_decode.py).
4. Final hidden state with 10 injected facts (encoding window 0 / 32) vs one joint prefill.
5. Answer accuracy and TTFT, facts injected (window 0 / 32) vs prefilled, on a seeded QA set of
   200 questions, k = 1, 10, 50 (bench/memory_accuracy.py; a trained model only, or --quick).
`--only SECTION,...` runs some of: ttft, decode, recall, deviation, accuracy.
How each is measured: the `settings` of the report (built in run below).
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ...memory.embedder import load_embedder
from ...session import Session
from . import BenchOptions, SuiteResult
from .memory_accuracy import accuracy_section
from .memory_decode import decode_rows
from .memory_ttft import fresh, targets, ttft_rows
from .timing import announcer, make_clock, percentile

KS, QUICK_KS = (1, 5, 10, 25, 50), (1, 10, 50)
TTFT_REPS, QUICK_TTFT_REPS = 7, 2                 # opts.steps overrides: timed reps per k and path
RECALL_FACTS, QUICK_RECALL_FACTS = 10_000, 2_000
REMEMBERED, QUICK_REMEMBERED = 300, 50            # of those, facts written through Session.remember
QUERIES, QUICK_QUERIES = 50, 20
RECALL_K = 10
WINDOWS, DEVIATION_K, DEVIATION_QUESTIONS = (0, 32), 10, 4
REGION_TOKENS, KV_POOL_MB, MAX_CONTEXT = 2048, 512, 4096
TARGET_RATIO, TARGET_GROWTH = 5.0, 1.5           # prefilled/injected at k=50; injected k=50 / k=1
SECTIONS = ("ttft", "decode", "recall", "deviation", "accuracy")

SYSTEM = ("system: you are the warehouse robot's assistant. Answer only from the facts you were "
          "given about parts, bays and technicians; if a fact is missing, say that it is unknown.\n")
QUESTION = "user: which warehouse bay holds the parts for project Osprey, and who logged them?\nassistant:"
COLORS = ("crimson", "teal", "amber", "violet", "olive", "silver", "cobalt", "scarlet", "ivory", "jade")
THINGS = ("gearbox", "servo motor", "lidar unit", "battery pack", "gripper finger", "torque sensor",
          "camera module", "drive belt", "coolant pump", "wheel hub")
NAMES = ("Mara Quill", "Tomas Reyes", "Ines Okafor", "Lev Sato", "Ada Brandt", "Ravi Menon", "Nora Falk")
PROJECTS = ("Osprey", "Kestrel", "Heron", "Falcon", "Plover", "Merlin", "Swift", "Tern")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


def make_facts(n: int, seed: int) -> list[tuple[str, str]]:
    """n distinct keyword-rich facts (~30 tokens) with a query aimed at each, reproducible per seed."""
    rng, out = random.Random(seed), []
    for i in range(n):
        color, thing = rng.choice(COLORS), rng.choice(THINGS)
        code = f"{rng.choice('BDFKMRTX')}{rng.choice('ACELNPSW')}-{seed % 10}{i:05d}"  # unique per fact
        text = (f"The {color} {thing} {code} sits in warehouse bay {rng.randint(1, 40)}, shelf "
                f"{rng.choice('ABCDEFGH')}; {rng.choice(NAMES)} logged it {rng.choice(DAYS)} for "
                f"project {rng.choice(PROJECTS)}.\n")
        out.append((text, f"where is the {color} {thing} {code}?"))
    return out


def _lat(fn: Callable[[str], Any], queries: list[str]) -> tuple[list[float], list[Any]]:
    fn(queries[0])                                       # warm-up
    times, outs = [], []
    for q in queries:
        t0 = time.perf_counter()
        outs.append(fn(q))
        times.append(time.perf_counter() - t0)
    return times, outs


def _recall(tmp: Path, opts: BenchOptions, n_facts: int, n_remember: int, n_queries: int,
            say: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    emb = load_embedder("auto")
    spec = None if emb is None else "auto"
    facts = make_facts(n_facts, seed=2)
    path, open_kw = tmp / "recall", dict(model=opts.model, device=opts.device,
                                         runtime={"kv_pool_mb": 64, "max_context": MAX_CONTEXT})
    with Session.open(path, memory={"embedder": spec}, **open_kw) as s:
        mem, store = s.memory, s.memory.store     # store: the store's facts (a FactTable)
        s.remember(facts[0][0])                          # warm-up (loads the embedder)
        t0 = time.perf_counter()
        for text, _ in facts[1:n_remember]:
            s.remember(text)
        remember_rate = (n_remember - 1) / (time.perf_counter() - t0)
        kv, n_tok = store.fact_kv(1), store.facts([1])[0].n_tokens
        t0 = time.perf_counter()
        for i in range(n_remember, n_facts, 256):      # the rest: straight into the store
            chunk = [t for t, _ in facts[i:i + 256]]
            vecs = None if emb is None else emb.embed(chunk)
            for j, text in enumerate(chunk):
                store.add_fact(text, n_tokens=n_tok, fingerprint=mem.fingerprint, rope=mem.rope, kv=kv,
                               embedding=None if vecs is None else vecs[j].numpy().astype("<f4").tobytes(),
                               embedder=None if emb is None else emb.name)
        fill_s = time.perf_counter() - t0
    say(f"recall store: {n_facts} facts ({n_remember} remembered at {remember_rate:.1f}/s), fill {fill_s:.1f} s")
    rng = random.Random(3)
    picks = [rng.randrange(n_facts) for _ in range(n_queries)]
    queries = [facts[j][1] for j in picks]

    def row(mode: str, times: list[float] | None, outs: list[Any] = (), note: str = "") -> dict[str, Any]:
        hits = [j + 1 in {h.id if hasattr(h, "id") else h[0] for h in out}
                for j, out in zip(picks, outs)]          # fact ids are 1.. in add order
        return {"mode": mode, "facts": n_facts, "queries": len(queries), "k": RECALL_K,
                "p50_ms": percentile(times, 50) * 1e3 if times else None,
                "p99_ms": percentile(times, 99) * 1e3 if times else None,
                "hit_at_k": sum(hits) / len(hits) if hits else None, "note": note}

    rows = []
    with Session.open(path, memory={"embedder": None}, restore=False, **open_kw) as s:
        rows.append(row("lexical (BM25)", *_lat(lambda q: s.recall(q, RECALL_K), queries)))
    if emb is None:
        rows += [row(m, None, note="no embedder") for m in ("embedding only", "hybrid")]
        return rows, {"remember_facts_per_s": remember_rate, "fill_s": fill_s, "embedder": None}
    with Session.open(path, memory={"embedder": spec}, restore=False, **open_kw) as s:
        t0 = time.perf_counter()
        s.recall(queries[0], RECALL_K)                   # the first recall stacks every stored embedding
        index_s = time.perf_counter() - t0
        index = s.memory.embedding_index()
        rows.append(row("embedding only", *_lat(lambda q: index.search(emb.embed([q])[0], RECALL_K), queries),
                        note="query embed + cosine top-k"))
        rows.append(row("hybrid", *_lat(lambda q: s.recall(q, RECALL_K), queries), note="Session.recall"))
    return rows, {"remember_facts_per_s": remember_rate, "fill_s": fill_s, "embedder": emb.name,
                  "index_load_s": index_s}


@contextmanager
def _final_hidden(model: Any) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Record (hidden, logits) of every model.lm_head call: a prefill's last-token final (normed)
    hidden state goes through it. The wrapper is an instance attribute, removed on exit."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner = model.lm_head

    def spy(h: torch.Tensor) -> torch.Tensor:
        logits = inner(h)
        seen.append((h.detach().float().cpu(), logits.detach().float().cpu()))
        return logits

    model.lm_head = spy
    try:
        yield seen
    finally:
        del model.lm_head


def _deviation(tmp: Path, opts: BenchOptions, tok: Any, say: Callable[[str], None]) -> list[dict[str, Any]]:
    facts = [t for t, _ in make_facts(DEVIATION_K, seed=4)]
    questions = [f"user: which warehouse bay holds the {t}, and who logged it?\nassistant:"
                 for t in THINGS[:DEVIATION_QUESTIONS]]
    # a region of exactly the facts' tokens: the fewest holes (positions) between facts and question
    region = sum(len(tok.encode(f)) for f in facts)
    rows = []
    for w in WINDOWS:
        with Session.open(tmp / f"deviation-w{w}", model=opts.model, device=opts.device,
                          runtime={"kv_pool_mb": 64, "max_context": MAX_CONTEXT},
                          memory={"window": w, "embedder": None, "region_tokens": region,
                                  "max_fact_tokens": region}) as s:
            texts = {s.remember(f, context=SYSTEM): f for f in facts}  # window w: last w system tokens
            model, errs, lerrs, agree, same = s.engine.runner.model, [], [], 0, True
            for i, q in enumerate(questions):
                with _final_hidden(model) as got:        # injected: system [region: 10 facts] question
                    s.generate(1, stream=fresh(s, f"inj-{i}", SYSTEM, q), memory_k=DEVIATION_K)
                order = s.engine.streams[f"inj-{i}"].region.fact_ids
                body = "".join(texts[f] for f in order)  # joint: the same text, prefilled causally
                joint = s.tokens(fresh(s, f"joint-{i}", SYSTEM, body + q))
                with _final_hidden(model) as ref:
                    s.generate(1, stream=f"joint-{i}")
                (h, lg), (h0, lg0) = got[-1], ref[-1]
                errs.append(((h - h0).norm() / h0.norm()).item())
                lerrs.append(((lg - lg0).norm() / lg0.norm()).item())
                agree += int(lg.argmax() == lg0.argmax())
                parts = tok.encode(SYSTEM) + sum((tok.encode(texts[f]) for f in order), []) + tok.encode(q)
                same &= len(order) == DEVIATION_K and joint == parts  # tokens as when injected
        rows.append({"window": w, "facts": DEVIATION_K, "questions": len(questions),
                     "hidden_rel_err_mean": statistics.mean(errs), "hidden_rel_err_max": max(errs),
                     "logits_rel_err_mean": statistics.mean(lerrs), "top1_agree": agree / len(questions),
                     "same_tokens": same})
        say(f"deviation window {w}: hidden rel err {statistics.mean(errs):.4f}")
    return rows


def run(opts: BenchOptions) -> SuiteResult:
    """Run the memory suite; opts.steps (if set) is the number of timed reps per TTFT point;
    opts.only (if set) names the sections to run."""
    bad = sorted(set(opts.only) - set(SECTIONS))
    if bad:
        raise ValueError(f"unknown memory section(s) {bad}; sections: {', '.join(SECTIONS)}")
    only = set(opts.only or SECTIONS)
    ks = QUICK_KS if opts.quick else KS
    reps = opts.steps or (QUICK_TTFT_REPS if opts.quick else TTFT_REPS)
    n_facts, n_remember, n_queries = ((QUICK_RECALL_FACTS, QUICK_REMEMBERED, QUICK_QUERIES) if opts.quick
                                      else (RECALL_FACTS, REMEMBERED, QUERIES))

    say = announcer("memory", opts.progress)

    load_start = os.getloadavg()[0]                    # other work on the machine skews timings
    results: dict[str, Any] = {}
    tables: dict[str, list[dict[str, Any]]] = {}
    how: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="capsule-bench-memory-") as d:
        tmp = Path(d)
        with Session.open(tmp / "ttft", model=opts.model, device=opts.device,
                          runtime={"kv_pool_mb": KV_POOL_MB, "max_context": MAX_CONTEXT},
                          memory={"region_tokens": REGION_TOKENS, "embedder": None}) as s:
            device, tok = s.engine.pool.tensor.device, s.tokenizer
            untrained = bool(getattr(s.model_info, "untrained", False))
            settings = {"model": opts.model, "untrained": untrained, "device": str(device),
                        "dtype": s.profile.runtime.dtype, "quick": opts.quick,
                        "torch_threads": torch.get_num_threads(), "sections": [x for x in SECTIONS if x in only]}
            if "ttft" in only:
                ttft, growth = ttft_rows(s, [t for t, _ in make_facts(max(ks), seed=1)], ks, reps, SYSTEM,
                                         QUESTION, make_clock(device), say)
                goals = targets(ttft, growth, TARGET_RATIO, TARGET_GROWTH)
                results.update(ttft=ttft, growth=growth, targets=goals)
                tables["TTFT: injected vs prefilled facts"] = ttft
                how.update(ttft=TTFT_HOW.format(reps=reps), ks=list(ks), ttft_reps=reps,
                           region_tokens=REGION_TOKENS, max_context=MAX_CONTEXT, kv_pool_mb=KV_POOL_MB,
                           question_tokens=len(tok.encode(QUESTION)), system_tokens=len(tok.encode(SYSTEM)))
        if "decode" in only:
            results["decode"] = decode_rows(tmp, opts, {"kv_pool_mb": 64, "max_context": MAX_CONTEXT}, SYSTEM,
                                            QUESTION, [t for t, _ in make_facts(5, seed=5)], say)
            tables["decode step with a memory region"] = results["decode"]
            how["decode"] = DECODE_HOW
        if "recall" in only:
            results["recall"], results["remember"] = _recall(tmp, opts, n_facts, n_remember, n_queries, say)
            tables.update({"recall latency": results["recall"], "remember and fill": [results["remember"]]})
            how["recall"] = RECALL_HOW.format(n_facts=n_facts, n_remember=n_remember, n_queries=n_queries,
                                              k=RECALL_K)
        if "deviation" in only:
            results["deviation"] = _deviation(tmp, opts, tok, say)
            tables["injected vs joint prefill deviation"] = results["deviation"]
            how["deviation"] = DEVIATION_HOW
        if "ttft" in only:
            tables["targets"] = results["targets"]
        if "accuracy" in only:
            results["accuracy"], acc_tables, how["accuracy"] = accuracy_section(tmp, opts, untrained, say)
            tables.update(acc_tables)
    settings.update(how)
    settings["load_average_1m"] = f"{load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    return SuiteResult(settings=settings, results=results, tables=tables)


TTFT_HOW = ("median of {reps} reps per k (after 1 warm-up; paths interleaved), each on a fresh stream, greedy; "
            "injected = wall time of generate(1, memory_k=k) on SYSTEM + QUESTION (BM25 recall of "
            "the k facts, their host-cached pre-RoPE K/V rotated and scattered into the stream's "
            "memory region, prefill of system + question, first token); prefill = generate(1) on "
            "SYSTEM + the same k facts' texts in the same order + QUESTION. Embedder off here. "
            "Growth target: then the same number of injected reps at the smallest and largest k, "
            "alternated, so both follow the same work (in the table a k=50 rep follows a "
            "1,500-token prefill rep; bench/memory_ttft.py)")
DECODE_HOW = ("per region size (none, 512, 2048) a fresh session: system + question with 5 facts "
              "injected, then one decode row stepped repeatedly (idempotent); median step after "
              "10 warm-up, eager with the region's empty blocks left out vs reading every block "
              "(what a CUDA graph does)")
RECALL_HOW = ("{n_facts} facts: {n_remember} via Session.remember, the rest via store.add_fact "
              "reusing one fact's K/V bytes (recall reads no K/V), with real embeddings when an "
              "embedder is installed; remember_facts_per_s includes embedding each fact; "
              "{n_queries} queries, k={k}, p50/p99 after 1 warm-up; hit_at_k: the fact the "
              "query was made from is returned")
DEVIATION_HOW = (f"{DEVIATION_K} facts injected (encoded after the last `window` tokens of SYSTEM) "
                 "vs the same system + facts + question prefilled as one text; relative L2 error "
                 "of the final normed hidden state (and logits) at the question's last token, "
                 f"mean over {DEVIATION_QUESTIONS} questions; region = the facts' tokens exactly (block-"
                 "aligned), so the question sits < 2 KV blocks later than in the joint text")
