"""Readers on other threads (load_newest_valid, epochs + load_epoch, verify, facts + fact_kv)
while one writer checkpoints, group-commits, retains, compacts and writes facts: every read is
exact for the epoch it names and reports no damage; only UnknownEpoch / UnknownFact (for what the
writer dropped meanwhile) may be raised. Then the kill oracle on the closed store.
"""
from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

from ...memory.facterrors import UnknownFact
from ...store import Store, UnknownEpoch
from . import reliability_harness as H
from . import reliability_tally as T
from .reliability_ledger import Ledger
from . import reliability_oracle as O


READ_WAIT_S = 2.0   # most a writer step waits for a reader to finish one read


def run_concurrency(work: Path, *, writes: int = 120, readers: int = 2, signed: bool = False,
                    seed: int = 0) -> T.Tally:
    tally, lock = T.Tally(), threading.Lock()
    key = H.SIGN_KEY if signed else None
    path = work / f"concurrent-{seed}-{int(signed)}"
    shutil.rmtree(path, ignore_errors=True)
    ledger = Ledger()
    st = Store.open(path, segment_bytes=H.SEGMENT_BYTES, sign_key=key)
    stop = threading.Event()
    # the writer lets a read finish after each of its steps (bounded wait): on a loaded machine
    # the reader threads could otherwise get almost no time while the writer runs (2 reads in
    # 80 writes on CI), and a read beside no write proves nothing
    read_done = threading.Event()

    def fail(what: str, detail: str) -> None:
        with lock:
            tally.fail(f"concurrency: {what}", T.describe(family="concurrency", seed=seed, signed=signed) +
                       f" :: {detail}")

    def writer() -> None:
        rng, seq, facts = random.Random(seed), seed * 1000 + 500, []
        try:
            for k in range(writes):
                e = (st.latest_epoch() or 0) + 1
                op = rng.choices(("write", "group", "retain", "compact", "fact", "forget"), (8, 3, 2, 2, 2, 1))[0]
                if op == "write":
                    ledger.acked.add(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id)
                elif op == "group":
                    for j in range(3):
                        st.stage_epoch(H.pages_for(e + j), H.manifest(e + j), name=H.epoch_name(e + j))
                    ledger.acked.update(i.id for i in st.sync())
                elif op == "retain":
                    ledger.droppable = max([ledger.droppable] + [i.id for i in st.epochs()[:-H.KEEP] if i.name is None])
                    st.retain(H.KEEP)
                elif op == "compact":
                    st.compact()
                elif op == "fact":
                    fid = H.add_fact(st, seq)
                    ledger.facts[fid], seq = seq, seq + 1
                    facts.append(fid)
                elif facts:
                    fid = facts.pop(0)
                    ledger.forget_tried.add(fid)
                    H.facts(st).forget_fact(fid)
                    ledger.forgotten.add(fid)
                if readers:
                    read_done.wait(READ_WAIT_S)
                    read_done.clear()
        except Exception as exc:  # noqa: BLE001
            fail(f"the writer raised {type(exc).__name__}", str(exc))
        finally:
            stop.set()

    def reader(r: int) -> None:
        rng = random.Random(seed * 100 + r)
        while not stop.is_set():
            what = rng.choice(("newest", "epoch", "verify", "facts"))
            try:
                if what == "newest":
                    found = st.load_newest_valid()
                    if found is not None:
                        e, man, pages, skipped = found
                        why = O.diff_view(pages, H.expected_view(e)) or (bytes(man) != H.manifest(e) and "manifest")
                        if skipped or why:
                            fail("load_newest_valid during writes is not clean", f"epoch {e}: {why} {skipped[:2]}")
                elif what == "epoch":
                    ids = [i.id for i in st.epochs()]
                    if ids != sorted(set(ids)):
                        fail("epochs() not increasing", str(ids))
                    if ids:
                        e = rng.choice(ids)
                        try:
                            why = O.check_epoch(st, e)
                        except UnknownEpoch:
                            why = ""
                        if why and "UnknownEpoch" not in why:
                            fail("load_epoch during writes", why)
                elif what == "verify":
                    report = st.verify()
                    if not report.ok:
                        fail("verify() during writes is not ok", str(list(report.problems)[:3]))
                else:
                    for f in H.facts(st).facts():
                        try:
                            kv = H.facts(st).fact_kv(f.id)
                        except UnknownFact:
                            continue
                        seq = H.fact_seq(f.text)
                        if seq is None or kv != H.fact_kv(seq, 1):
                            fail("fact_kv during writes gave wrong bytes", f"fact {f.id}")
                with lock:
                    tally.add("concurrent reads")
                read_done.set()
            except Exception as exc:  # noqa: BLE001
                fail(f"a reader ({what}) raised {type(exc).__name__}", str(exc))

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(r,)) for r in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st.close()
    for p in O.check_store(path, ledger, sign_key=key):
        fail(T.cause_of(p), p)
    tally.add("concurrent writes", writes)
    return tally
