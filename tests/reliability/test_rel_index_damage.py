"""Reliability: damage to index.sqlite / -wal / -shm only, from a power-cut image (copied while the
writer had the store open: WAL and shm present) and from a cleanly closed store.

Contract (the segment log is the truth, the index a rebuildable cache): the newest acknowledged
epoch is restored bit-exactly, or, only if that cannot be avoided, a CapsuleError is raised and no
segment byte was deleted or changed. Never an older epoch, nothing restored, a wrong byte, an
untyped exception, or fewer segment bytes (quarantine/ included) than were committed; after a
recovery the store takes a new epoch. A failure lists each cause with a recipe (image, seed,
trial, damage kind / file / offsets, the damaged input kept before the open, and a replay
command: python -m capsule.tools.bench.reliability_damage index SEED TRIAL [--signed] [--clean]).
"""
from __future__ import annotations

import random
import shutil

import pytest

from capsule.tools.bench import reliability_damage as D
from capsule.tools.bench import reliability_harness as H


def test_random_index_damage_restores_the_newest_epoch_or_refuses_typed(work):
    tally = D.run_damage(work, "index", 160, seed=0)
    assert tally.counts["index damages"] == 160
    assert not tally.failures, tally.report()


@pytest.fixture(scope="module")
def images():
    root = H.work_dir(__name__ + "-images")
    yield {"plain": D.build_images(root, 11, False), "signed": D.build_images(root, 12, True)}
    shutil.rmtree(root, ignore_errors=True)   # rebuilt the same way by the next run


def _flip_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _cut(path, keep):
    path.write_bytes(path.read_bytes()[:keep(path.stat().st_size)])


CASES = {
    # (image: 0 power-cut / 1 clean, what is done to the copy)
    "wal-bit-flip": (0, lambda f: _flip_middle(f / "index.sqlite-wal")),
    "wal-torn-at-half": (0, lambda f: _cut(f / "index.sqlite-wal", lambda n: n // 2)),
    "wal-and-shm-deleted": (0, lambda f: [(f / n).unlink() for n in ("index.sqlite-wal", "index.sqlite-shm")]),
    "shm-garbage": (0, lambda f: (f / "index.sqlite-shm").write_bytes(random.Random(5).randbytes(32768))),
    "index-deleted-wal-kept": (0, lambda f: (f / "index.sqlite").unlink()),
    "index-truncated-512": (1, lambda f: _cut(f / "index.sqlite", lambda n: 512)),
    "index-deleted": (1, lambda f: (f / "index.sqlite").unlink()),
    "index-page-2-zeroed": (1, lambda f: (f / "index.sqlite").write_bytes(
        (f / "index.sqlite").read_bytes()[:4096] + bytes(4096) + (f / "index.sqlite").read_bytes()[8192:])),
}


@pytest.mark.parametrize("signed", ["plain", "signed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_named_index_damage(images, work, case, signed):
    which, damage = CASES[case]
    img = images[signed][which]
    folder = work / "s"
    H.copy_store(img.folder, folder)
    damage(folder)
    kept = work / "input"
    shutil.copytree(folder, kept)
    outcome, problems = D.judge(folder, img, "index")
    assert not problems, (f"index damage {case!r} on the {img.label} image (newest acknowledged epoch "
                          f"{img.newest}, damaged input kept at {kept}): outcome {outcome}: {problems}")
