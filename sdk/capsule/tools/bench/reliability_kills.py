"""SIGKILL trials: writer children killed at random moments, then the kill oracle on the store.

A fork server (the "zygote") imports the store once (flavor "store": capsule.store without
capsule/__init__, so no torch; flavor "session": all of capsule) and forks one writer per trial;
the zygote itself sleeps the trial's delay and SIGKILLs the child it forked (a pid it has not
reaped yet, so never someone else's), then reaps it. A child writes its ledger (see
reliability_ledger) to a file with unbuffered writes, which survive its death.

Trials come in chains: one store, several writer lives, each killed, each followed by the
oracle (which also writes one epoch: the store must be usable). A chain's first kill often lands
inside the very first Store.open that creates the store.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import reliability_harness as H
from . import reliability_tally as T
from .reliability_ledger import Ledger
from . import reliability_oracle as O

SDK = str(Path(__file__).resolve().parents[2])

ZYGOTE = r'''
import json, os, signal, sys, time, traceback, types
sdk, flavor = sys.argv[1], sys.argv[2]
if flavor == "store":        # capsule.store without capsule/__init__ (no torch): fast forks
    pkg = types.ModuleType("capsule"); pkg.__path__ = [os.path.join(sdk, "capsule")]
    sys.modules["capsule"] = pkg
else:
    import capsule, capsule.session, numpy
from capsule.tools.bench import reliability_children as K
from capsule.store import Store
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fd = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1); os.dup2(fd, 2)
            K.child_main(req)
        except BaseException:
            traceback.print_exc(); sys.stderr.flush(); code = 3
        os._exit(code)
    time.sleep(req["delay"])
    os.kill(pid, signal.SIGKILL)      # our own unreaped child (a zombie at worst): never another process
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"pid": pid, "status": status}), flush=True)
'''


class Zygote:
    """One fork server process; run() forks a writer, kills it after `delay` s, returns its status."""

    def __init__(self, flavor: str):
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, SDK, flavor], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the {flavor} zygote did not start: {self.proc.stderr.read()[-2000:]}")

    def run(self, req: dict) -> int:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died: {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def check_session(path: Path, ledger: Ledger, model: str | None, signed: bool,
                  notes: list[str] | None = None) -> list[str]:
    from .reliability_children import open_session, session_digest, session_step
    """Session kill oracle: open restores >= the newest acknowledged epoch, reports nothing, and
    its state is bit-exactly the state the writer had at that step; then the store itself."""
    problems = []
    try:
        s = open_session(str(path), model, signed)
    except Exception as exc:  # noqa: BLE001
        return [f"Session.open raised {type(exc).__name__}: {exc}"]
    try:
        if ledger.acked and (s.restored_epoch is None or s.restored_epoch < ledger.newest):
            problems.append(f"restored epoch {s.restored_epoch} < newest acknowledged {ledger.newest}")
        if notes is not None:   # what recovery said (a kill is no damage: a note, not a failure)
            notes += s.restore_report
        if s.restored_epoch is not None:
            step = s.state.get("step")
            want = ledger.digests.get(step, set())
            got = session_digest(s)
            if got not in want:
                problems.append(f"restored epoch {s.restored_epoch} (step {step}) state digest {got} is none of "
                                f"the writer's digests for that step {sorted(want)[:2]}")
            elif isinstance(step, int) and step + 1 in ledger.digests:   # the continuation is exact too
                session_step(s, step + 1)
                got = session_digest(s)
                if got not in ledger.digests[step + 1]:
                    problems.append(f"after restoring epoch {s.restored_epoch} (step {step}) the next step's digest "
                                    f"{got} differs from the writer's {sorted(ledger.digests[step + 1])[:2]}")
    finally:
        s.close()
    if not problems:
        from ...store import Store
        try:
            with Store.open(path, sign_key=H.SIGN_KEY if signed else None) as st:
                found = st.load_newest_valid()
                if found is not None and found[3]:
                    problems.append(f"store skipped epochs after a kill: {found[3][:2]}")
                report = st.verify()
                if not report.ok:
                    problems.append(f"verify() after a kill: {list(report.problems)[:3]}")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"Store.open after the Session raised {type(exc).__name__}: {exc}")
    return problems


# -- trials -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChainSpec:
    kind: str               # "store" or "session"
    seed: int
    kills: int
    signed: bool = False
    wait: bool = True       # session: checkpoint(wait=...)
    model: str | None = None


def kind_label(spec: ChainSpec) -> str:
    if spec.kind == "store":
        return "store" + (" signed" if spec.signed else "")
    return f"session {spec.model or 'builtin:gru'} wait={spec.wait}"


class OpenWindow:
    """When (s after fork) the first Store.open of a writer ran, from the W lines of earlier first
    lives: later first lives aim about half their kills into it (the open that creates the store)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[tuple[float, float]]] = {}
        self.lock = threading.Lock()

    def learn(self, kind: str, text: str) -> None:
        marks = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "W" and parts[1] not in marks:
                try:
                    marks[parts[1]] = float(parts[2])
                except ValueError:
                    pass
        if "store-open-start" in marks and "store-open-end" in marks:
            with self.lock:
                self.seen.setdefault(kind, []).append((marks["store-open-start"], marks["store-open-end"]))

    def pick(self, kind: str, rng: random.Random) -> float | None:
        with self.lock:
            seen = sorted(self.seen.get(kind, []))
        if not seen:
            return None
        start, end = seen[len(seen) // 2]
        return rng.uniform(max(0.0, start - 0.002), end + 0.002)


WINDOWS = OpenWindow()


def delay_for(rng: random.Random, kind: str, first: bool, aim: float = 0.5) -> float:
    if first and rng.random() < aim:
        aimed = WINDOWS.pick(kind, rng)
        if aimed is not None:
            return aimed
    if kind == "store":
        if first and rng.random() < 0.5:
            return rng.uniform(0.0, 0.012)    # inside the first open, which creates the store
        return rng.choice([rng.uniform(0.0, 0.02), rng.uniform(0.0, 0.08), rng.uniform(0.02, 0.25)])
    if first and rng.random() < 0.3:
        return rng.uniform(0.0, 0.06)
    return rng.uniform(0.03, 0.4)


def run_chain(spec: ChainSpec, root: Path, zygote: Zygote, tally: T.Tally, lock: threading.Lock) -> None:
    rng = random.Random(spec.seed)
    path = root / f"{spec.kind}-{spec.seed}"
    ledger = Ledger()
    for life in range(spec.kills):
        ack, err = root / f"{path.name}.{life}.ack", root / f"{path.name}.{life}.err"
        delay = delay_for(rng, spec.kind, life == 0, 0.9 if spec.kills == 1 else 0.5)
        req = {"kind": spec.kind, "path": str(path), "ack": str(ack), "err": str(err), "delay": delay,
               "seed": spec.seed * 1000 + life, "signed": spec.signed, "fresh": life == 0,
               "facts": ledger.live_facts(), "seq": (spec.seed * 1000 + life) * 1000, "wait": spec.wait,
               "model": spec.model}
        status = zygote.run(req)
        text = ack.read_text() if ack.exists() else ""
        ledger.feed(text)
        if life == 0:
            WINDOWS.learn(spec.kind, text)
        where = ledger.last_op or "startup (before its first line)"
        recipe = T.describe(family="kill", chain=spec.__dict__, life=life, delay_s=round(delay, 5),
                            killed_in=where, acked_newest=ledger.newest, store=str(path))
        with lock:
            tally.add("kills")
            tally.add(f"kills {kind_label(spec)}")
            tally.add(f"killed in {where.split()[0] if where else '?'}")
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9):
            why = err.read_text()[-1500:] if err.exists() else ""
            with lock:
                tally.fail("writer child failed before its kill (a store call raised)", f"{recipe} :: {why}")
        notes: list[str] = []
        if spec.kind == "store":
            problems = O.check_store(path, ledger, sign_key=H.SIGN_KEY if spec.signed else None, notes=notes)
        else:
            problems = check_session(path, ledger, spec.model, spec.signed, notes)
        with lock:
            if any("rebuilt" in n for n in notes):
                tally.add("reopens after a kill that rebuilt the index")
            for p in problems:
                if "acknowledged epochs lost" in p or "< newest acknowledged" in p:
                    tally.add("acknowledged epochs lost", 1)
                tally.fail(f"kill ({spec.kind}): {T.cause_of(p)}", f"{recipe} :: {p}")
        for f in (ack, err):
            f.unlink(missing_ok=True)
        if problems:
            break    # the chain's store is now outside the model: keep it for a post-mortem, stop here
    with lock:
        tally.add("acknowledged epochs", len(ledger.acked))


def run_kills(root: Path, chains: list[ChainSpec], workers: int = 2) -> T.Tally:
    """Run every chain on `workers` threads, each with its own zygotes; returns the tally."""
    tally, lock = T.Tally(), threading.Lock()
    root.mkdir(parents=True, exist_ok=True)
    queue = list(chains)
    qlock = threading.Lock()

    def worker() -> None:
        zygotes: dict[str, Zygote] = {}
        try:
            while True:
                with qlock:
                    if not queue:
                        return
                    spec = queue.pop(0)
                flavor = "store" if spec.kind == "store" else "session"
                if flavor not in zygotes:
                    zygotes[flavor] = Zygote(flavor)
                run_chain(spec, root, zygotes[flavor], tally, lock)
        finally:
            for z in zygotes.values():
                z.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        for fut in [pool.submit(worker) for _ in range(workers)]:
            fut.result()
    tally.add("kill wall ms", int((time.perf_counter() - t0) * 1000))
    return tally


def plan(store_kills: int, session_kills: int, *, seed: int = 0, per_chain: int = 8,
         tiny_kills: int = 0, first_opens: int = 0) -> list[ChainSpec]:
    """Chains adding up to the requested kills: store chains (a quarter signed), session chains
    alternating wait=True / wait=False (policy builtin:gru; tiny_kills of them with builtin:tiny),
    then first_opens one-kill store chains and as many session chains, aimed (once the window is
    known from earlier chains) into the first Store.open, which creates the store."""
    chains, s = [], seed * 10_000
    while store_kills > 0:
        n = min(per_chain, store_kills)
        chains.append(ChainSpec("store", s, n, signed=s % 4 == 3))
        store_kills, s = store_kills - n, s + 1
    k = 0
    for total, model in ((session_kills - tiny_kills, None), (tiny_kills, "builtin:tiny")):
        while total > 0:
            n = min(4, total)
            chains.append(ChainSpec("session", s, n, wait=k % 2 == 0, signed=k % 5 == 4, model=model))
            total, s, k = total - n, s + 1, k + 1
    for j in range(first_opens):
        chains.append(ChainSpec("store", s, 1, signed=j % 4 == 3))
        chains.append(ChainSpec("session", s + 1, 1, wait=j % 2 == 0))
        s += 2
    return chains
