"""Crash-state enumeration of the commit protocol.

A scripted workload (store creation, write_epoch, stage_epoch + sync group commits, retain,
compact, add_fact, set_fact_kv, forget_fact, close + reopen) runs in-process with a recording
FileOps. Before and after every file operation, and after every API call, the recorder takes the
state a power cut at that moment could leave:

- index.sqlite (+ -wal / -shm) as they are (SQLite with synchronous=FULL is crash-safe at its
  own commit boundaries, so its state is the copy taken at that moment);
- each segment file in one of these variants: kept (everything written survived); dropped
  (cut back to its content at its last fsync, absent if its directory entry was never fsynced,
  back with its last synced content if it was unlinked without a directory fsync since); torn
  (cut at a random point of its unsynced part); zeroed (its unsynced part zero-filled).

Each distinct state is rebuilt in its own folder and checked with the kill oracle against the
ledger of what was acknowledged at that moment. The first open's own states (the folder, LOCK,
an empty or schema-less index) are added explicitly: SQLite writes them, not FileOps
(reliability_firstopen.py). The recording FileOps and its durability model: reliability_recording.py.
"""
from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

from ...store import FileOps, Store  # noqa: F401 (FileOps: for RecordingFS subclasses, as C.FileOps)
from . import reliability_harness as H
from . import reliability_oracle as O
from . import reliability_tally as T
from .reliability_firstopen import creation_states
from .reliability_ledger import Ledger
from .reliability_recording import FileModel, RecordingFS

INDEX_FILES = ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm")


class Enumerator:
    """Takes, dedups, varies and checks crash states of one workload's store folder."""

    def __init__(self, work: Path, folder: Path, key: bytes | None, seed: int, tears: int):
        self.work, self.folder, self.key, self.tears = work, folder, key, tears
        self.rng = random.Random(seed)
        self.seed = seed
        self.ledger = Ledger()
        self.fs = RecordingFS(self.snapshot)
        self.seen: set[bytes] = set()
        self.tally = T.Tally()
        self.where = ""

    def snapshot(self, label: str) -> None:
        if not self.folder.exists():
            return
        index = {n: (self.folder / n).read_bytes() for n in INDEX_FILES if (self.folder / n).exists()}
        segs = {}
        for p in sorted((self.folder / "segments").glob("*.seg")):
            m = self.fs.model.get(str(p)) or FileModel(p.read_bytes(), True)
            segs[p.name] = (p.read_bytes(), m.durable, m.entry)
        ghosts = {Path(g).name: d for g, d in self.fs.ghosts.items()}
        h = hashlib.sha1()
        for part in (index, segs, ghosts):
            h.update(repr(sorted((k, hashlib.sha1(repr(v).encode()).digest()) for k, v in part.items())).encode())
        h.update(repr((sorted(self.ledger.acked), self.ledger.droppable, sorted(self.ledger.facts.items()),
                       sorted(self.ledger.kv_tried.items()), sorted(self.ledger.forget_tried))).encode())
        digest = h.digest()
        if digest in self.seen:
            return
        self.seen.add(digest)
        for name, files in self._variants(segs, ghosts):
            self._check(f"{self.where} / {label}", name, index, files)

    def _variants(self, segs: dict, ghosts: dict):
        yield "kept", {n: cur for n, (cur, _, _) in segs.items()}
        unsynced = {n for n, (cur, dur, entry) in segs.items() if cur != dur or not entry}
        if not unsynced and not ghosts:
            return
        dropped = {n: dur for n, (cur, dur, entry) in segs.items() if entry}
        dropped.update(ghosts)
        yield "dropped", dropped
        tails = {n for n, (cur, dur, _) in segs.items() if len(cur) > len(dur) and cur.startswith(dur)}
        for t in range(self.tears if tails else 0):
            torn = {}
            for n, (cur, dur, _) in segs.items():
                torn[n] = cur[:self.rng.randrange(len(dur), len(cur))] if n in tails else cur
            yield f"torn#{t}", torn
        if tails:
            yield "zeroed", {n: (dur + bytes(len(cur) - len(dur)) if n in tails else cur)
                             for n, (cur, dur, _) in segs.items()}

    def _check(self, where: str, variant: str, index: dict, files: dict) -> None:
        n = self.tally.counts.get("crash states", 0)
        folder = self.work / f"state-{self.seed}-{n}"
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "segments").mkdir(parents=True)
        for name, data in index.items():
            (folder / name).write_bytes(data)
        for name, data in files.items():
            (folder / "segments" / name).write_bytes(data)
        ledger = self.ledger.copy()
        problems = O.check_store(folder, ledger, sign_key=self.key)
        self.tally.add("crash states")
        self.tally.add("crash states recovered" if not problems else "crash states failed")
        for p in problems:
            self.tally.fail(f"crash state ({variant.split('#')[0]}): {T.cause_of(p)}",
                            T.describe(family="crash state", seed=self.seed, signed=self.key is not None,
                                       at=where, variant=variant, acked_newest=self.ledger.newest,
                                       kept=str(folder)) + f" :: {p}")
        if not problems:
            shutil.rmtree(folder, ignore_errors=True)


def workload(size: int) -> list[tuple]:
    """The scripted calls; size scales the number of epochs (2 -> ~14 epochs, 6 -> ~40)."""
    steps: list[tuple] = [("open",)]
    for r in range(size):
        steps += [("write",), ("write",), ("group", 3), ("add_fact",), ("write",), ("set_kv",),
                  ("group", 2), ("retain",), ("write",), ("compact",)]
        steps += [("forget",), ("reopen",), ("write",)] if r % 2 else [("add_fact",), ("write",)]
    return steps + [("retain",), ("compact",), ("write",), ("close",)]


def run_workload(en: Enumerator, steps: list[tuple]) -> None:
    L, st, seq, facts = en.ledger, None, en.seed * 1000, []
    for k, step in enumerate(steps):
        op = step[0]
        en.where = f"step {k} {op}"
        if op in ("open", "reopen"):
            if st is not None:
                st.close()
            st = Store.open(en.folder, segment_bytes=H.SEGMENT_BYTES, sign_key=en.key, fs=en.fs)
        elif op == "close":
            st.close()
            st = None
        elif op == "write":
            e = (st.latest_epoch() or 0) + 1
            L.acked.add(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id)
        elif op == "group":
            e = (st.latest_epoch() or 0) + 1
            for j in range(step[1]):
                st.stage_epoch(H.pages_for(e + j), H.manifest(e + j), name=H.epoch_name(e + j))
            L.acked.update(i.id for i in st.sync())
        elif op == "add_fact":
            fid = H.add_fact(st, seq)
            L.facts[fid] = seq
            facts.append([fid, seq, 2])
            seq += 1
        elif op == "set_kv" and facts:
            f = facts[-1]
            L.kv_tried[f[0]] = f[2]
            H.set_fact_kv(st, f[0], f[1], f[2])
            L.kv_acked[f[0]] = f[2]
            f[2] += 1
        elif op == "forget" and facts:
            fid = facts.pop(0)[0]
            L.forget_tried.add(fid)
            H.facts(st).forget_fact(fid)
            L.forgotten.add(fid)
        elif op == "retain":
            drop = [i.id for i in st.epochs()[:-H.KEEP] if i.name is None]
            L.droppable = max([L.droppable] + drop)
            st.retain(H.KEEP)
        elif op == "compact":
            st.compact()
        en.snapshot(f"after {op}")
    if st is not None:
        st.close()


def run_crash_states(work: Path, *, size: int = 2, seeds: tuple[int, ...] = (0,), signed: tuple[bool, ...] = (False,),
                     tears: int = 1) -> T.Tally:
    tally = T.Tally()
    work.mkdir(parents=True, exist_ok=True)
    for key in {H.SIGN_KEY if s else None for s in signed}:
        tally.merge(creation_states(work, key))
        for seed in seeds:
            folder = work / f"live-{seed}-{key is not None}"
            shutil.rmtree(folder, ignore_errors=True)
            en = Enumerator(work, folder, key, seed, tears)
            run_workload(en, workload(size))
            en.tally.add("file operations recorded", en.fs.ops)
            tally.merge(en.tally)
            shutil.rmtree(folder, ignore_errors=True)
    return tally
