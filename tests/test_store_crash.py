"""capsule.store under crashes: SIGKILL at random moments, unsynced epochs, failures inside compaction."""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from capsule.store import FileOps, Store, StoreError

SDK = str(Path(__file__).resolve().parents[1] / "sdk")

# shared by the child (which writes) and the parent (which checks): page bytes are a pure
# function of (epoch, region, index), so the parent knows every epoch's exact view
PATTERN = '''
import hashlib

def content(e, region, i):
    return hashlib.sha256(f"{e}/{region}/{i}".encode()).digest() * 6

def pages_for(e):
    return [("kv", e - 1, content(e, "kv", e - 1)), ("state", e % 5, content(e, "state", e % 5)),
            ("rng", 0, content(e, "rng", 0))]

def manifest(e):
    return b'{"epoch": %d}' % e
'''

# the child imports capsule.store without capsule/__init__ (no torch): a fast start per trial
CHILD = '''
import os, random, sys, types
pkg = types.ModuleType("capsule")
pkg.__path__ = [os.path.join(sys.argv[1], "capsule")]
sys.modules["capsule"] = pkg
from capsule.store import Store
''' + PATTERN + '''
path, mode, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = random.Random(seed)
store = Store.open(path, segment_bytes=8192)
e = (store.latest_epoch() or 0) + 1
print("ready", flush=True)
while True:
    if mode == "write":
        store.write_epoch(pages_for(e), manifest(e))
        print(e, flush=True)                        # acknowledged: durable
        e += 1
    elif mode == "stage":
        for _ in range(rng.randint(1, 4)):
            assert store.stage_epoch(pages_for(e), manifest(e)) == e
            e += 1
        for info in store.sync():
            print(info.id, flush=True)
    else:                                           # "unsynced": 3 durable epochs, 2 staged, then die
        for _ in range(3):
            print(store.write_epoch(pages_for(e), manifest(e)).id, flush=True)
            e += 1
        store.stage_epoch(pages_for(e), manifest(e)); store.stage_epoch(pages_for(e + 1), manifest(e + 1))
        os._exit(0)
    if e % 7 == 0:                                  # crashes inside retention / compaction too
        store.retain(4)
        store.compact()
'''

shared: dict = {}
exec(PATTERN, shared)


def expected_view(epoch: int) -> dict[str, dict[int, bytes]]:
    view: dict[str, dict[int, bytes]] = {}
    for e in range(1, epoch + 1):
        for region, i, data in shared["pages_for"](e):
            view.setdefault(region, {})[i] = data
    return view


def spawn(path: Path, mode: str, seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, SDK, str(path), mode, str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def kill_trial(path: Path, mode: str, seed: int) -> tuple[int, int]:
    """Run a writer child, SIGKILL it after a random delay, then check the reopened store."""
    child = spawn(path, mode, seed)
    ready = child.stdout.readline()
    assert ready.strip() == b"ready", child.stderr.read().decode()
    # mostly short delays, so kills land in the first commits, rotations and compactions alike
    try:
        child.wait(timeout=random.Random(seed).choice([0.0, 0.003, 0.02, 0.05, 0.1, 0.2]))
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.read().decode()
    acked = [int(x) for x in child.stdout.read().split()]
    last = max(acked, default=0)
    with Store.open(path) as st:
        latest = st.latest_epoch() or 0
        assert latest >= last, f"seed {seed}: acknowledged {last}, store has {latest}"
        found = st.load_newest_valid()
        if last == 0 and found is None:
            return last, 0
        epoch, manifest, pages, skipped = found
        assert epoch >= last and skipped == [], f"seed {seed}: {skipped}"
        assert json.loads(manifest) == {"epoch": epoch} and pages == expected_view(epoch), f"seed {seed}"
        for info in st.epochs()[-3:]:  # older retained epochs are exact too
            assert st.load_epoch(info.id)[1] == expected_view(info.id), f"seed {seed}: epoch {info.id}"
        report = st.verify()
        assert report.ok, f"seed {seed}: {report.problems}"
        assert st.write_epoch(shared["pages_for"](latest + 1), b"{}").id == latest + 1  # usable again
    return last, epoch


@pytest.mark.parametrize("mode", ["write", "stage"])
def test_sigkill_never_loses_an_acknowledged_epoch(tmp_path, mode):
    seeds = [1000 * (mode == "stage") + i for i in range(16)]  # 2 x 16 = 32 trials
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: kill_trial(tmp_path / f"t{s}", mode, s), seeds))
    assert sum(last > 0 for last, _ in results) >= 4  # kills landed after some commits, not only before


@pytest.mark.parametrize("tear", [False, True])
def test_unsynced_staged_epochs_are_adopted_whole_or_cut(tmp_path, tear):
    # staged, never synced nor acknowledged: after the process dies, an epoch whose records all
    # reached the file comes back whole (the log is the truth); a torn one is cut, never half-used
    child = spawn(tmp_path / "s", "unsynced", 0)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err.decode()
    assert out.split()[1:] == [b"1", b"2", b"3"]
    seg = sorted((tmp_path / "s" / "segments").glob("*.seg"))[-1]
    if tear:
        os.truncate(seg, seg.stat().st_size - 7)        # epoch 5's manifest record cut short
    size_with_staged = seg.stat().st_size
    with Store.open(tmp_path / "s") as st:
        latest = 4 if tear else 5
        assert st.latest_epoch() == latest and "adopted" in st.recovery_report[0]   # the tail, not a rebuild
        assert seg.stat().st_size < size_with_staged if tear else seg.stat().st_size == size_with_staged
        assert st.load_newest_valid()[:3:2] == (latest, expected_view(latest))
        assert st.write_epoch(shared["pages_for"](latest + 1), b"{}").id == latest + 1
        assert st.load_epoch(latest + 1)[1] == expected_view(latest + 1) and st.verify().ok
    assert not (tmp_path / "s" / "quarantine").exists() or not list((tmp_path / "s" / "quarantine").glob("*tail*"))


class FailAt(FileOps):
    """Raises EIO from the n-th call of one operation: a crash at that point of compaction."""

    def __init__(self) -> None:
        self.op, self.countdown = "", 0

    def _tick(self, op: str) -> None:
        if op == self.op:
            self.countdown -= 1
            if self.countdown == 0:
                raise OSError(errno.EIO, "injected I/O error")

    def write(self, fd, data):
        self._tick("write")
        return super().write(fd, data)

    def fsync(self, fd):
        self._tick("fsync")
        return super().fsync(fd)

    def unlink(self, path):
        self._tick("unlink")
        return super().unlink(path)


def build(path: Path, fs: FileOps) -> Store:
    st = Store.open(path, segment_bytes=4096, fs=fs)
    for e in range(1, 41):
        st.write_epoch(shared["pages_for"](e), shared["manifest"](e), name="keep" if e == 5 else None)
    st.retain(3)
    return st


def check_all(st: Store) -> None:
    for info in st.epochs():
        assert st.load_epoch(info.id) == (shared["manifest"](info.id), expected_view(info.id))


@pytest.mark.parametrize("op,nth", [("write", 1), ("write", 3), ("fsync", 1), ("unlink", 1), ("unlink", 2)])
def test_failure_inside_compaction_keeps_every_epoch(tmp_path, op, nth):
    fs = FailAt()
    st = build(tmp_path / "s", fs)
    fs.op, fs.countdown = op, nth
    try:
        if op == "unlink":  # after the commit point: compaction succeeds, leftovers go at next open
            assert st.compact() > 0
        else:
            with pytest.raises(StoreError, match="compaction failed"):
                st.compact()
        check_all(st)
        fs.op = ""
        st.write_epoch(shared["pages_for"](41), shared["manifest"](41))
    finally:
        st.close()
    with Store.open(tmp_path / "s", segment_bytes=4096) as st:
        check_all(st)
        assert st.verify().ok, st.verify().problems
        st.compact()
        check_all(st)
        assert st.verify().ok


def test_retention_and_compaction_bound_the_disk(tmp_path):
    with Store.open(tmp_path / "s", segment_bytes=4096) as st:
        sizes = []
        for e in range(1, 301):
            # no append-only region here, so everything older than the kept epochs dies
            st.write_epoch([p for p in shared["pages_for"](e) if p[0] != "kv"], shared["manifest"](e),
                           name="keep" if e == 10 else None)
            if e % 10 == 0:
                st.retain(3)
                st.compact()
                sizes.append(st.stats()["segment_bytes"])
        assert max(sizes[5:]) < 24 << 10, sizes  # bounded, not growing with history
        kept = [i.id for i in st.epochs()]
        assert kept == [10, 298, 299, 300]
        for e in kept:
            view = {r: {i: d for i, d in v.items()} for r, v in expected_view(e).items() if r != "kv"}
            assert st.load_epoch(e)[1] == view
        assert st.verify().ok
