"""Disk full and EIO: injected through FileOps at every call index of a workload, and for real on
a small tmpfs (mount needs root; skipped only when mount itself is refused).

Oracle: every failure is a StoreIOError (a CapsuleError; a failed open may be its parent
StoreError); nothing acknowledged is lost; once the fault is gone ("space is freed") the same
Store object writes again, and a reopen passes the kill oracle.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from ...errors import CapsuleError, StoreError
from ...store import FileOps, Store, StoreIOError
from . import reliability_harness as H
from . import reliability_tally as T
from .reliability_ledger import Ledger
from . import reliability_oracle as O
from .reliability_crash import workload

OPS = ("write", "fsync", "fsync_dir", "truncate", "open", "unlink")
MODES = {"once": (1, ()), "stuck": (5, OPS), "cleanup": (3, ("truncate", "unlink", "fsync"))}


class FaultFS(FileOps):
    """Raises OSError(err) from the at-th call of `op`, then from the next span-1 calls of the
    ops in `also` (the disk stays full / broken for a while). at=0: only counts calls."""

    def __init__(self, op: str = "", at: int = 0, err: int = errno.ENOSPC, span: int = 1, also=()):
        self.op, self.at, self.err, self.span, self.also = op, at, err, span, set(also) | {op}
        self.counts: Counter = Counter()
        self.left = 0
        self.injected = 0
        self.off = False

    def _gate(self, op: str) -> None:
        if self.off:
            return
        self.counts[op] += 1
        if op == self.op and self.counts[op] == self.at:
            self.left = self.span
        if self.left > 0 and op in self.also:
            self.left -= 1
            self.injected += 1
            raise OSError(self.err, f"{os.strerror(self.err)} (injected at {op} call {self.counts[op]})")

    def open(self, path, flags, mode=0o600):
        self._gate("open")
        return super().open(path, flags, mode)

    def write(self, fd, data):
        self._gate("write")
        return super().write(fd, data)

    def fsync(self, fd):
        self._gate("fsync")
        return super().fsync(fd)

    def fsync_dir(self, path):
        self._gate("fsync_dir")
        return super().fsync_dir(path)

    def truncate(self, fd, length):
        self._gate("truncate")
        return super().truncate(fd, length)

    def unlink(self, path):
        self._gate("unlink")
        return super().unlink(path)


def drive(path: Path, fs: FileOps, steps: list[tuple], key: bytes | None, ledger: Ledger,
          on_error) -> Store | None:
    """Run the scripted calls, tolerating (and reporting) failures; returns the open Store."""
    st, seq, facts = None, 7000, []
    for op, *args in steps:
        try:
            if op in ("open", "reopen") or st is None:
                if st is not None:
                    st.close()
                    st = None
                st = Store.open(path, segment_bytes=H.SEGMENT_BYTES, sign_key=key, fs=fs)
                if op in ("open", "reopen"):
                    continue
            if op == "close":
                continue
            e = (st.latest_epoch() or 0) + 1
            if op == "write":
                ledger.acked.add(_id(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id, e))
            elif op == "group":
                try:
                    for j in range(args[0]):
                        _id(st.stage_epoch(H.pages_for(e + j), H.manifest(e + j), name=H.epoch_name(e + j)), e + j)
                finally:
                    ledger.acked.update(i.id for i in st.sync())
            elif op == "add_fact":
                fid = H.add_fact(st, seq)
                ledger.facts[fid] = seq
                facts.append([fid, seq, 2])
                seq += 1
            elif op == "set_kv" and facts:
                f = facts[-1]
                ledger.kv_tried[f[0]] = f[2]
                f[2] += 1
                H.set_fact_kv(st, f[0], f[1], f[2] - 1)
                ledger.kv_acked[f[0]] = f[2] - 1
            elif op == "forget" and facts:
                fid = facts.pop(0)[0]
                ledger.forget_tried.add(fid)
                H.facts(st).forget_fact(fid)
                ledger.forgotten.add(fid)
            elif op == "retain":
                ledger.droppable = max([ledger.droppable] + [i.id for i in st.epochs()[:-H.KEEP] if i.name is None])
                st.retain(H.KEEP)
            elif op == "compact":
                st.compact()
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified by on_error
            on_error(op, exc)
    return st


def _id(got: int, want: int) -> int:
    assert got == want, f"the store gave epoch id {got}, the workload expected {want}"
    return got


def fault_trial(work: Path, op: str, at: int, err: int, mode: str, key: bytes | None, size: int) -> tuple[int, list[str]]:
    """One injected-fault run; returns (faults injected, problems)."""
    path = work / f"fault-{op}-{at}-{err}-{mode}-{key is not None}"
    shutil.rmtree(path, ignore_errors=True)
    span, also = MODES[mode]
    fs = FaultFS(op, at, err, span, also)
    ledger, problems = Ledger(), []

    def on_error(what: str, exc: Exception) -> None:
        ok = isinstance(exc, StoreIOError) or (what in ("open", "reopen") and isinstance(exc, StoreError))
        if not ok:
            problems.append(f"{what} failed with {type(exc).__name__} (want StoreIOError): {exc}")
    st = None
    try:
        st = drive(path, fs, workload(size), key, ledger, on_error)
        fs.off = True                                   # space freed / disk fixed
        if st is None:
            st = Store.open(path, segment_bytes=H.SEGMENT_BYTES, sign_key=key, fs=fs)
        found = st.load_newest_valid()
        if ledger.acked and (found is None or found[0] < ledger.newest):
            problems.append(f"in-process after the fault: restored {found and found[0]} < newest acknowledged "
                            f"{ledger.newest}")
        e = (st.latest_epoch() or 0) + 1
        try:
            ledger.acked.add(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id)
            fid = H.add_fact(st, 99_000)
            ledger.facts[fid] = 99_000
        except CapsuleError as exc:
            problems.append(f"not usable after the fault was gone: {type(exc).__name__}: {exc}")
    except AssertionError as exc:
        problems.append(f"workload: {exc}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"raised {type(exc).__name__} outside a store call's contract: {exc}")
    finally:
        if st is not None:
            try:
                st.close()
            except Exception as exc:  # noqa: BLE001
                problems.append(f"close after the fault raised {type(exc).__name__}: {exc}")
    problems += O.check_store(path, ledger, sign_key=key)
    if not problems:
        shutil.rmtree(path, ignore_errors=True)
    return fs.injected, problems


def run_faults(work: Path, *, size: int = 1, errs=(errno.ENOSPC, errno.EIO), modes=tuple(MODES),
               stride: int = 1, signed: bool = False) -> T.Tally:
    """Every call index (every stride-th) of every op, for each errno and mode."""
    tally = T.Tally()
    work.mkdir(parents=True, exist_ok=True)
    key = H.SIGN_KEY if signed else None
    dry = FaultFS()
    probe = work / "fault-probe"
    shutil.rmtree(probe, ignore_errors=True)
    st = drive(probe, dry, workload(size), key, Ledger(), lambda op, exc: None)
    if st is not None:
        st.close()
    shutil.rmtree(probe, ignore_errors=True)
    k = 0
    for op in OPS:
        for at in range(1, max(dry.counts[op], 1 if op == "truncate" else 0) + 1):
            for err in errs:
                for mode in modes:
                    k += 1
                    if (k - 1) % stride:
                        continue
                    injected, problems = fault_trial(work, op, at, err, mode, key, size)
                    tally.add("fault runs")
                    tally.add("faults injected", injected)
                    for p in problems:
                        tally.fail(f"disk fault ({op}): {T.cause_of(p)}",
                                   T.describe(family="disk fault", op=op, call=at, errno=errno.errorcode[err],
                                              mode=mode, signed=signed, workload_size=size) + f" :: {p}")
    tally.add("fault calls counted", sum(dry.counts.values()))
    return tally


# -- a real full disk ---------------------------------------------------------------------------------
def run_tmpfs(work: Path, *, size_mb: int = 4, rounds: int = 2) -> T.Tally:
    """Fill a real tmpfs until the store fails, free space, continue; twice. 'tmpfs skipped' when
    mount is refused (not root, or no tmpfs)."""
    tally = T.Tally()
    mnt = work / "tmpfs"
    mnt.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=60)
        refused = r.returncode != 0
    except (OSError, subprocess.SubprocessError):   # no mount(8) here
        refused = True
    if refused:
        tally.add("tmpfs skipped (mount refused)")
        return tally
    try:
        _fill_and_free(mnt, tally, rounds)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    return tally


def _fill_and_free(mnt: Path, tally: T.Tally, rounds: int) -> None:
    path, ledger = mnt / "s", Ledger()
    st = Store.open(path, segment_bytes=H.SEGMENT_BYTES)
    seq = 50_000

    def note(what: str, exc: Exception) -> None:
        tally.add("tmpfs failures")
        if not isinstance(exc, StoreIOError):
            tally.fail(f"real disk full: {what} raised {type(exc).__name__}, not StoreIOError",
                       T.describe(family="tmpfs", what=what, acked_newest=ledger.newest) + f" :: {exc}")
    for rnd in range(rounds):
        free = shutil.disk_usage(mnt).free
        filler = mnt / f"filler{rnd}"
        with open(filler, "wb") as f:   # leave ~400 KiB: the store runs out within a few dozen commits
            f.write(b"\0" * max(0, free - (400 << 10)))
        fails = 0
        for i in range(4000):
            e = (st.latest_epoch() or 0) + 1
            try:
                if i % 7 == 3:
                    fid = H.add_fact(st, seq)
                    ledger.facts[fid], seq = seq, seq + 1
                elif i % 11 == 5:
                    st.retain(H.KEEP)
                    st.compact()
                else:
                    ledger.acked.add(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id)
                fails = 0
            except Exception as exc:  # noqa: BLE001
                note("write_epoch / add_fact / compact on a full disk", exc)
                fails += 1
                if fails >= 6:
                    break
        ledger.droppable = max([ledger.droppable] + [x.id for x in st.epochs()[:-H.KEEP] if x.name is None])
        tally.add("tmpfs full disks")
        for e in sorted(ledger.must_have() & {x.id for x in st.epochs()})[-5:]:
            why = O.check_epoch(st, e)
            if why:
                tally.fail("real disk full: an acknowledged epoch reads back wrong on the full disk",
                           T.describe(family="tmpfs", epoch=e) + f" :: {why}")
        filler.unlink()                  # space freed: the same Store object must write again
        for _ in range(5):
            e = (st.latest_epoch() or 0) + 1
            try:
                ledger.acked.add(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id)
            except Exception as exc:  # noqa: BLE001
                tally.fail("real disk full: not usable after space was freed",
                           T.describe(family="tmpfs", round=rnd, epoch=e) + f" :: {type(exc).__name__}: {exc}")
        ledger.droppable = max([ledger.droppable] + [x.id for x in st.epochs()[:-H.KEEP] if x.name is None])
        st.retain(H.KEEP)
        st.compact()
    st.close()
    for p in O.check_store(path, ledger):
        tally.fail(f"real disk full, reopened: {T.cause_of(p)}", T.describe(family="tmpfs") + f" :: {p}")
