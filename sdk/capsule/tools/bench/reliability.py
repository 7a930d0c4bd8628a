"""`capsule bench --suite reliability`: the project's own reliability campaign, in one table.

The same harness as tests/reliability/ (bench/reliability_*.py), at campaign size:

1. SIGKILLs at random moments: store writers (write_epoch, group commits, retention, compaction,
   fact writes, the first open that creates the store, signed stores) and Sessions
   (model=None, policy builtin:gru; some builtin:tiny; checkpoint wait=True and wait=False);
   each followed by the kill oracle (reliability_oracle.check_store / reliability_kills).
2. Crash-state enumeration of the commit protocol (reliability_crash): every state a power
   cut could leave around every file operation of a scripted workload, unsynced segment bytes
   kept / dropped / torn / zeroed.
3. Damage: bit flips, torn / cut / deleted files, swapped and zeroed pages in index.sqlite,
   -wal and -shm (power-cut and clean images), and in segments (reliability_damage).
4. Disk full / EIO injected through FileOps at every call index, and a real full tmpfs
   (reliability_faults); readers beside a writer (reliability_concurrency); hostile inputs and
   signing keys (reliability_hostile); damage seen through a Session (reliability_session).

--quick: about a minute. --steps N: N store SIGKILLs (the other sizes scale with it).
Exit status is 0 either way; the table's "must" column says what a healthy store shows, and
results.json lists every failing cause with one reproducible recipe.
"""
from __future__ import annotations

import multiprocessing
import resource
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

from . import BenchOptions, SuiteResult
from . import reliability_harness as H
from . import reliability_tally as T

FULL = {"first_opens": 60, "store_kills": 1000, "session_kills": 120, "tiny_kills": 20, "damages": (6000, 6000), "session_damages": 300,
        "crash": (4, (0, 1), 2), "fault_stride": 1, "tmpfs_rounds": 2, "writes": 300, "hostile_rounds": 3}
QUICK = {"first_opens": 8, "store_kills": 150, "session_kills": 16, "tiny_kills": 4, "damages": (500, 500), "session_damages": 30,
         "crash": (1, (0,), 1), "fault_stride": 4, "tmpfs_rounds": 1, "writes": 100, "hostile_rounds": 1}


def _task(name: str, args: tuple) -> T.Tally:
    """One campaign part, run in a worker process (spawned: no torch state forked)."""
    from . import reliability_crash as C, reliability_damage as D, reliability_faults as F
    work = Path(args[0])
    if name == "damage":
        return D.run_damage(work, args[1], args[2], seed=args[3])
    if name == "crash":
        return C.run_crash_states(work, size=args[1], seeds=args[2], signed=args[3], tears=args[4])
    if name == "faults":
        return F.run_faults(work, size=1, stride=args[1], signed=args[2])
    raise ValueError(name)


def run(opts: BenchOptions) -> SuiteResult:
    from . import reliability_faults as F, reliability_hostile as X, reliability_kills as K
    from .reliability_concurrency import run_concurrency
    from .reliability_session import run_session_damage
    size = dict(QUICK if opts.quick else FULL)
    if opts.steps is not None:
        scale = opts.steps / size["store_kills"]
        size["store_kills"] = opts.steps
        size["session_kills"] = max(4, int(size["session_kills"] * scale))
        size["tiny_kills"] = min(size["session_kills"] // 2, max(0, int(size["tiny_kills"] * scale)))
    say: Callable[[str], None] = (lambda m: print(m, flush=True)) if opts.progress else (lambda m: None)
    root = Path(tempfile.mkdtemp(prefix="capsule-reliability-"))     # kills: on the real disk
    fast = H.work_dir(f"campaign-{time.strftime('%Y%m%d-%H%M%S')}")   # the rest: see fast_root
    t0, parts, walls = time.perf_counter(), T.Tally(), {}

    def part(label: str, fn: Callable[[], T.Tally]) -> None:
        t = time.perf_counter()
        say(f"  {label} ...")
        tally = fn()
        walls[label] = time.perf_counter() - t
        say(f"  {label}: {len(tally.failures)} failing, {walls[label]:.1f} s")
        parts.merge(tally)

    n_index, n_seg = size["damages"]
    pool_jobs = [("damage", (str(fast / "dmg-i0"), "index", n_index // 2, 0)),
                 ("damage", (str(fast / "dmg-i1"), "index", n_index - n_index // 2, 1000)),
                 ("damage", (str(fast / "dmg-s0"), "segments", n_seg // 2, 0)),
                 ("damage", (str(fast / "dmg-s1"), "segments", n_seg - n_seg // 2, 1000))]
    c_size, c_seeds, c_tears = size["crash"]
    pool_jobs += [("crash", (str(fast / f"crash-{s}"), c_size, c_seeds, (s,), c_tears)) for s in (False, True)]
    pool_jobs += [("faults", (str(fast / "faults-u"), size["fault_stride"], False)),
                  ("faults", (str(fast / "faults-s"), size["fault_stride"] * 3, True))]
    try:
        part("SIGKILLs", lambda: K.run_kills(root / "kills", K.plan(
            size["store_kills"], size["session_kills"], tiny_kills=size["tiny_kills"], first_opens=size["first_opens"])))
        ctx = multiprocessing.get_context("spawn")

        def pooled() -> T.Tally:
            out = T.Tally()
            with ProcessPoolExecutor(2, mp_context=ctx) as pool:
                for fut in [pool.submit(_task, n, a) for n, a in pool_jobs]:
                    out.merge(fut.result())
            return out
        part("damage, crash states, disk faults (2 processes)", pooled)
        part("damage through a Session", lambda: run_session_damage(fast / "sdmg", size["session_damages"]))
        part("real full disk (tmpfs)", lambda: F.run_tmpfs(fast / "tmpfs", rounds=size["tmpfs_rounds"]))
        part("readers beside a writer",
             lambda: T.Tally().merge(run_concurrency(fast / "conc", writes=size["writes"]))
             .merge(run_concurrency(fast / "conc", writes=size["writes"], signed=True, seed=1)))
        part("hostile inputs", lambda: X.run_hostile(fast / "hostile", rounds=size["hostile_rounds"]))
    finally:
        if not parts.failures:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(fast, ignore_errors=True)
    wall = time.perf_counter() - t0
    rows = table(parts, wall)
    groups = grouped(parts)
    if groups:
        say(f"\n{len(parts.failures)} failing checks in {len(groups)} causes (one recipe each; folders kept "
            f"under {root} and {fast}):")
        for g in groups[:25]:
            say(f"  [{g['count']}x] {g['cause']}\n      {g['recipe'][:600]}")
    settings = {"quick": opts.quick, "sizes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in size.items()},
                "segment_bytes": H.SEGMENT_BYTES, "keep": H.KEEP, "work_dirs": [str(root), str(fast)],
                "part_wall_s": {k: round(v, 2) for k, v in walls.items()}}
    results = {"counts": parts.counts, "failures": groups, "failing_checks": len(parts.failures)}
    return SuiteResult(settings, results, {"reliability campaign": rows})


def grouped(tally: T.Tally) -> list[dict[str, Any]]:
    groups: dict[str, list[str]] = {}
    for cause, recipe in tally.failures:
        groups.setdefault(cause, []).append(recipe)
    return [{"cause": c, "count": len(r), "recipe": r[0]} for c, r in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


MODELS = ("builtin:gru", "builtin:tiny")


def _c(t: T.Tally, *keys: str) -> int:
    return sum(t.counts.get(k, 0) for k in keys)


def _failed(t: T.Tally, prefix: str) -> int:
    return sum(1 for cause, _ in t.failures if cause.startswith(prefix))


def table(t: T.Tally, wall: float) -> list[dict[str, Any]]:
    dmg = ("index", "segments")
    injected = _c(t, "index damages", "segments damages", "session damages")
    by_file = " / ".join(f"{k.split()[1]} {t.counts.get(k, 0)}" for k in
                         ("damaged seg", "damaged sqlite", "damaged sqlite-wal", "damaged sqlite-shm",
                          "damaged sqlite-wal+shm"))
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    rows = [
        ("SIGKILLs (store writers [signed] / Session wait=True / wait=False [builtin:tiny])",
         f"{t.counts.get('kills', 0)} = {_c(t, 'kills store', 'kills store signed')} "
         f"[{t.counts.get('kills store signed', 0)}] / {_c(t, *(f'kills session {m} wait=True' for m in MODELS))} / "
         f"{_c(t, *(f'kills session {m} wait=False' for m in MODELS))} "
         f"[{_c(t, 'kills session builtin:tiny wait=True', 'kills session builtin:tiny wait=False')}]", ">= 1000 full"),
        ("acknowledged epochs checked after kills", t.counts.get("acknowledged epochs", 0), ""),
        ("acknowledged epochs lost", t.counts.get("acknowledged epochs lost", 0), "0"),
        ("kill-oracle failures (reopen raised, wrong bytes, facts, ...)", _failed(t, "kill") +
         _failed(t, "writer child"), "0"),
        ("reopens after a kill that rebuilt the index (a scan of the whole log)",
         t.counts.get("reopens after a kill that rebuilt the index", 0), ""),
        ("crash states enumerated", t.counts.get("crash states", 0), ""),
        ("crash states recovered", t.counts.get("crash states recovered", 0), "= enumerated"),
        ("damages injected (" + by_file + ")", injected, ">= 10000 full"),
        ("damage detected (typed refusal / reported fallback)",
         _c(t, *(f"{a} {o}" for a in dmg for o in ("refused", "fell-back-reported"))), ""),
        ("damage recovered exactly (newest epoch)", _c(t, "index recovered", "segments recovered"), ""),
        ("damage: silently wrong or empty", _c(t, "index wrong", "segments wrong"), "0"),
        ("damage: untyped exception", _c(t, "index untyped", "segments untyped"), "0"),
        ("damage: acknowledged epoch lost (older restored)", _c(t, "index older", "segments older"), "0"),
        ("damage: segment bytes lost / other oracle failures",
         f"{_c(t, 'index lost-bytes', 'segments lost-bytes')} / {_c(t, 'index other', 'segments other')}", "0 / 0"),
        ("disk-fault runs (ENOSPC/EIO via FileOps) / faults injected",
         f"{t.counts.get('fault runs', 0)} / {t.counts.get('faults injected', 0)}", ""),
        ("disk-fault oracle failures", _failed(t, "disk fault"), "0"),
        ("real full disk (tmpfs): failures raised / oracle failures",
         "mount refused" if t.counts.get("tmpfs skipped (mount refused)") else
         f"{t.counts.get('tmpfs failures', 0)} / {_failed(t, 'real disk full')}", "- / 0"),
        ("concurrent reads beside a writer / failures",
         f"{t.counts.get('concurrent reads', 0)} / {_failed(t, 'concurrency')}", "- / 0"),
        ("hostile inputs / refused / accepted or failed",
         f"{t.counts.get('hostile inputs', 0)} / {t.counts.get('hostile inputs refused', 0)} / "
         f"{_failed(t, 'hostile')}", "- / - / 0"),
        ("failing causes (see results.json)", len({c for c, _ in t.failures}), "0"),
        ("peak RSS MiB (this process / largest child)", f"{rss_self:.0f} / {rss_kids:.0f}", ""),
        ("wall time s", round(wall, 1), ""),
    ]
    return [{"check": a, "value": b, "must": c} for a, b, c in rows]
