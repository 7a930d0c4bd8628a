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
an empty or schema-less index) are added explicitly: SQLite writes them, not FileOps.
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ..store import FileOps, Store
from . import reliability_harness as H
from . import reliability_oracle as O

INDEX_FILES = ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm")


@dataclass
class FileModel:
    durable: bytes      # content at the last fsync (b"" if never synced)
    entry: bool         # the directory entry survived a power cut (created before, or a dir fsync since)


class RecordingFS(FileOps):
    """Real file operations, plus a model of what is durable and a state callback around each."""

    def __init__(self, on_state) -> None:
        self.on_state = on_state
        self.fd_path: dict[int, str] = {}
        self.model: dict[str, FileModel] = {}
        self.ghosts: dict[str, bytes] = {}     # unlinked, but the unlink is not durable yet
        self.ops = 0

    def _around(self, label: str, fn):
        self.on_state(f"before {label}")
        out = fn()
        self.ops += 1
        self.on_state(f"after {label}")
        return out

    def open(self, path, flags, mode=0o600):
        def do():
            existed = os.path.exists(path)
            fd = FileOps.open(self, path, flags, mode)
            self.fd_path[fd] = path
            if not existed:
                self.model[path] = FileModel(b"", False)
            elif path not in self.model:
                self.model[path] = FileModel(Path(path).read_bytes(), True)
            return fd
        return self._around(f"open {Path(path).name}", do)

    def write(self, fd, data):
        return self._around(f"write {len(data)} B to {Path(self.fd_path.get(fd, '?')).name}",
                            lambda: FileOps.write(self, fd, data))

    def fsync(self, fd):
        def do():
            FileOps.fsync(self, fd)
            path = self.fd_path.get(fd)
            if path in self.model:
                self.model[path].durable = Path(path).read_bytes()
        return self._around(f"fsync {Path(self.fd_path.get(fd, '?')).name}", do)

    def fsync_dir(self, path):
        def do():
            FileOps.fsync_dir(self, path)
            for p, m in self.model.items():
                if os.path.dirname(p) == str(path).rstrip("/"):
                    m.entry = True
            for p in [g for g in self.ghosts if os.path.dirname(g) == str(path).rstrip("/")]:
                del self.ghosts[p]
        return self._around("fsync_dir", do)

    def truncate(self, fd, length):
        return self._around(f"truncate {Path(self.fd_path.get(fd, '?')).name} to {length}",
                            lambda: FileOps.truncate(self, fd, length))

    def unlink(self, path):
        def do():
            FileOps.unlink(self, path)
            m = self.model.pop(path, None)
            if m is not None and m.entry:
                self.ghosts[path] = m.durable
        return self._around(f"unlink {Path(path).name}", do)

    def close(self, fd):
        def do():
            FileOps.close(self, fd)
            self.fd_path.pop(fd, None)
        return self._around("close", do)


class Enumerator:
    """Takes, dedups, varies and checks crash states of one workload's store folder."""

    def __init__(self, work: Path, folder: Path, key: bytes | None, seed: int, tears: int):
        self.work, self.folder, self.key, self.tears = work, folder, key, tears
        self.rng = random.Random(seed)
        self.seed = seed
        self.ledger = H.Ledger()
        self.fs = RecordingFS(self.snapshot)
        self.seen: set[bytes] = set()
        self.tally = H.Tally()
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
            self.tally.fail(f"crash state ({variant.split('#')[0]}): {H.cause_of(p)}",
                            H.describe(family="crash state", seed=self.seed, signed=self.key is not None,
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


def creation_states(work: Path, key: bytes | None) -> H.Tally:
    """States a kill inside the very first Store.open can leave (written by SQLite and mkdir)."""
    tally = H.Tally()
    probe = work / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    Store.open(probe, sign_key=key).close()
    schema = (probe / "index.sqlite").read_bytes()
    states = {"empty folder": {}, "LOCK only": {"LOCK": b""}, "LOCK + segments/": {"LOCK": b"", "segments/": None},
              "empty index.sqlite": {"LOCK": b"", "index.sqlite": b"", "segments/": None},
              "index.sqlite, empty WAL database": {"index.sqlite": _wal_db(work)},
              "index.sqlite without meta rows": {"index.sqlite": _without_meta(work, schema)},
              "index + an empty first segment file": {"index.sqlite": schema, "segments/000001.seg": b""}}
    for name, files in states.items():
        folder = work / f"create-{abs(hash(name))}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for rel, data in files.items():
            if data is None:
                (folder / rel).mkdir(exist_ok=True)
            else:
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_bytes(data)
        problems = O.check_store(folder, H.Ledger(), sign_key=key)
        tally.add("crash states")
        tally.add("crash states recovered" if not problems else "crash states failed")
        for p in problems:
            tally.fail(f"crash state (first open): {H.cause_of(p)}",
                       H.describe(family="crash state", at="first open", state=name, signed=key is not None,
                                  kept=str(folder)) + f" :: {p}")
    return tally


def _wal_db(work: Path) -> bytes:
    p = work / "wal.sqlite"
    p.unlink(missing_ok=True)
    conn = sqlite3.connect(p)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    return p.read_bytes()


def _without_meta(work: Path, schema: bytes) -> bytes:
    p = work / "nometa.sqlite"
    p.write_bytes(schema)
    conn = sqlite3.connect(p)
    try:
        conn.execute("DELETE FROM meta")
        conn.commit()
    except sqlite3.Error:
        pass
    conn.close()
    return p.read_bytes()


def run_crash_states(work: Path, *, size: int = 2, seeds: tuple[int, ...] = (0,), signed: tuple[bool, ...] = (False,),
                     tears: int = 1) -> H.Tally:
    tally = H.Tally()
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
