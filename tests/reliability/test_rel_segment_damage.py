"""Reliability: damage to segments (bit flips, flipped record / segment headers, torn tails, cut
files, zeroed ranges, a deleted segment file), through the Store and through a Session.

Contract: whatever epoch is restored is bit-exact for that epoch; if it is not the newest
acknowledged, the report is non-empty (load_newest_valid's skipped reports or Store.recovery_report;
Session.restore_report);
CapsuleCorrupt only when no epoch is intact on disk (an independent scanner written from
docs/FORMAT.md says which are). Never silently wrong, silently empty, or untyped. A failure lists
each cause with a recipe and a replay command
(python -m capsule.tools.bench.reliability_damage segments SEED TRIAL [--signed] [--clean]).
"""
from __future__ import annotations

import shutil

import pytest

from capsule.tools.bench import reliability_damage as D
from capsule.tools.bench import reliability_harness as H
from capsule.tools.bench import reliability_scan as S
from capsule.tools.bench.reliability_hostile import record_headers
from capsule.tools.bench.reliability_session import run_session_damage


def test_random_segment_damage_is_never_silent(work):
    tally = D.run_damage(work, "segments", 160, seed=0)
    assert tally.counts["segments damages"] == 160
    assert not tally.failures, tally.report()


def test_random_damage_through_a_session_is_never_silent(work):
    tally = run_session_damage(work, 24)
    assert tally.counts["session damages"] == 24
    assert not tally.failures, tally.report()


@pytest.fixture(scope="module")
def images():
    root = H.work_dir(__name__ + "-images")
    yield {"plain": D.build_images(root, 21, False), "signed": D.build_images(root, 22, True)}
    shutil.rmtree(root, ignore_errors=True)   # rebuilt the same way by the next run


def _newest_record(folder, img):
    for p, off, h in record_headers(folder):
        if h[2] == 1 and h[4] == img.newest:
            return p, off
    raise AssertionError("no page record of the newest epoch")


def _flip(path, off):
    data = bytearray(path.read_bytes())
    data[off] ^= 0x04
    path.write_bytes(bytes(data))


def _segs(folder):
    return sorted((folder / "segments").glob("*.seg"))


CASES = {
    "newest-page-payload-flip": lambda f, img: _flip(*(lambda p, o: (p, o + 60))(*_newest_record(f, img))),
    "newest-page-header-flip": lambda f, img: _flip(*(lambda p, o: (p, o + 9))(*_newest_record(f, img))),
    "last-segment-torn-100": lambda f, img: _segs(f)[-1].write_bytes(_segs(f)[-1].read_bytes()[:-100]),
    "last-segment-deleted": lambda f, img: _segs(f)[-1].unlink(),
    "first-segment-deleted": lambda f, img: _segs(f)[0].unlink(),
    "every-segment-deleted": lambda f, img: [p.unlink() for p in _segs(f)],
    "last-segment-header-flip": lambda f, img: _flip(_segs(f)[-1], 3),
    "first-record-zeroed": lambda f, img: _segs(f)[0].write_bytes(
        _segs(f)[0].read_bytes()[:24] + bytes(200) + _segs(f)[0].read_bytes()[224:]),
}


@pytest.mark.parametrize("signed", ["plain", "signed"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("which", [0, 1], ids=["power-cut", "clean"])
def test_named_segment_damage(images, work, case, signed, which):
    img = images[signed][which]
    folder = work / "s"
    H.copy_store(img.folder, folder)
    CASES[case](folder, img)
    kept = work / "input"
    shutil.copytree(folder, kept)
    intact = S.intact_epochs(folder, img.key, img.epochs)
    outcome, problems = D.judge(folder, img, "segments")
    assert not problems, (f"segment damage {case!r} on the {img.label} image (newest acknowledged epoch "
                          f"{img.newest}, intact on disk: {intact[-3:]}, damaged input kept at {kept}): "
                          f"outcome {outcome}: {problems}")
