"""Damage trials: index.sqlite / -wal / -shm damage and segment damage, each judged by its oracle.

Images: one store written by a known workload (epochs, group commits, facts, retention,
compaction), copied twice: a "power-cut image" (copied while the writer still has it open: the
WAL and shm are there) and a "clean image" (after close). Each trial copies an image, damages it
(deterministically from (seed, trial)), opens it and judges:

- index damage: the newest acknowledged epoch restored bit-exactly, or a CapsuleError with no
  segment byte deleted or changed. Never an older epoch, nothing restored, a wrong byte, an
  untyped exception, or fewer segment bytes (quarantine/ counted) than were committed.
- segment damage: whatever is restored is bit-exact; an epoch older than the newest acknowledged
  comes with a non-empty report; CapsuleCorrupt only when no epoch is intact on disk (checked by
  an independent scanner, reliability_scan). Never silently wrong, silently empty or untyped.

Replay one trial: python -m capsule.tools.bench.reliability_damage index|segments SEED TRIAL [--signed] [--clean]
"""
from __future__ import annotations

import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ...errors import CapsuleError
from ...store import Store
from . import reliability_harness as H
from . import reliability_tally as T
from .reliability_ledger import Ledger, span
from . import reliability_oracle as O
from . import reliability_scan as scan
from .reliability_inject import damage_index, damage_segments



@dataclass
class Image:
    folder: Path
    power_cut: bool
    key: bytes | None
    epochs: list[int]         # retained, acknowledged
    ledger: Ledger
    segs: dict[str, bytes]    # committed segment bytes

    @property
    def newest(self) -> int:
        return max(self.epochs)

    @property
    def label(self) -> str:
        return f"{'power-cut' if self.power_cut else 'clean'}{'-signed' if self.key else ''}"


def build_images(root: Path, seed: int, signed: bool) -> tuple[Image, Image]:
    """The workload, then (power-cut image, clean image) of the same store."""
    rng = random.Random(seed)
    key = H.SIGN_KEY if signed else None
    live = root / f"live-{seed}-{int(signed)}"
    shutil.rmtree(live, ignore_errors=True)
    ledger = Ledger()
    st = Store.open(live, segment_bytes=H.SEGMENT_BYTES, sign_key=key)
    e, seq, facts = 1, seed * 1000, []
    for step in range(22 + rng.randrange(8)):
        if step % 5 == 3:
            n = rng.randint(2, 3)
            for k in range(n):
                st.stage_epoch(H.pages_for(e + k), H.manifest(e + k), name=H.epoch_name(e + k))
            ledger.acked.update(i.id for i in st.sync())
            e += n
        else:
            ledger.acked.add(st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e)).id)
            e += 1
        if step % 4 == 1:
            fid = H.add_fact(st, seq)
            ledger.facts[fid], seq = seq, seq + 1
            facts.append(fid)
        if step == 9:
            H.set_fact_kv(st, facts[0], ledger.facts[facts[0]], 2)
            ledger.kv_tried[facts[0]] = ledger.kv_acked[facts[0]] = 2
            H.facts(st).forget_fact(facts[1])
            ledger.forget_tried.add(facts[1])
            ledger.forgotten.add(facts[1])
        if step in (12, 19):
            st.retain(H.KEEP)
            st.compact()
    epochs = [i.id for i in st.epochs()]
    pc = root / f"image-{seed}-{int(signed)}-power-cut"
    shutil.rmtree(pc, ignore_errors=True)
    H.copy_store(live, pc)                     # the writer still has it open: WAL and shm are there
    segs = H.seg_files(live)
    st.close()
    clean = root / f"image-{seed}-{int(signed)}-clean"
    shutil.rmtree(clean, ignore_errors=True)
    H.copy_store(live, clean)
    shutil.rmtree(live, ignore_errors=True)
    return (Image(pc, True, key, epochs, ledger, segs), Image(clean, False, key, epochs, ledger, dict(segs)))


# -- the oracles ------------------------------------------------------------------------------------
def judge(folder: Path, img: Image, area: str) -> tuple[str, list[str]]:
    """(outcome, problems). outcome: recovered | fell-back-reported | refused, or (see classify)
    untyped | wrong | older | lost-bytes | other.
    area: "index" (index-only damage), "segments", or "hostile" (crafted input: a typed refusal
    or an older epoch with a report is fine; a wrong byte or a silent fallback is not)."""
    intact = scan.intact_epochs(folder, img.key, img.epochs) if area == "segments" else list(img.epochs)
    try:
        st = Store.open(folder, sign_key=img.key, segment_bytes=H.SEGMENT_BYTES)
    except CapsuleError as exc:
        return _refused(folder, img, area, intact, f"Store.open raised {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        return "untyped", [f"Store.open raised untyped {type(exc).__name__}: {exc}"]
    problems: list[str] = []
    try:
        try:
            found = st.load_newest_valid()
        except CapsuleError as exc:
            return _refused(folder, img, area, intact, f"load_newest_valid raised {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001
            return "untyped", [f"load_newest_valid raised untyped {type(exc).__name__}: {exc}"]
        report = list(getattr(st, "recovery_report", None) or [])   # what recovery did at open (if kept)
        if found is None:
            on_disk = f"; intact on disk: {intact[-3:]}" if area == "segments" else ""
            return "wrong", [f"silently empty: load_newest_valid() is None while epochs {span(img.epochs)} "
                             f"were acknowledged{on_disk} (recovery_report: {_short(report)})"]
        epoch, man, pages, skipped = found
        skipped = list(skipped) + report
        why = O.diff_view(pages, H.expected_view(epoch)) or ("manifest differs" if bytes(man) != H.manifest(epoch)
                                                            else "")
        if why:
            return "wrong", [f"silently wrong: restored epoch {epoch} is not bit-exact: {why}"]
        outcome = "recovered"
        if epoch != img.newest:
            gone = "" if epoch in img.epochs else " (an epoch retention had dropped)"
            if area == "index":
                problems.append(f"index damage restored older epoch {epoch}{gone} instead of the newest "
                                f"acknowledged {img.newest} ({'report: ' + _short(skipped) if skipped else 'no report'})")
            elif not skipped:
                problems.append(f"silently older: restored epoch {epoch}{gone} (newest acknowledged {img.newest}) "
                                f"with an empty report")
            else:
                outcome = "fell-back-reported"
        for e in _epochs(st):
            w = O.check_epoch(st, e)
            if w and not w.startswith("refused"):
                problems.append(f"silently wrong: load_epoch({e}): {w}")
        problems += _facts(st)
        if area == "index":
            lost = H.lost_segment_bytes(img.segs, folder, exact=True)
            if lost:
                problems.append(f"segment bytes lost after index damage: {lost}")
            if outcome == "recovered" and not problems:
                problems += _usable(st, img)
    finally:
        try:
            st.close()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"close raised {type(exc).__name__}: {exc}")
    return (classify(problems) or outcome), problems


def _short(report: list[str]) -> str:
    return " | ".join(r[:160] for r in report[:3]) or "empty"


def classify(problems: list[str]) -> str:
    """The worst outcome the problems show: untyped > wrong (a wrong byte, or nothing restored)
    > older (an acknowledged epoch lost) > lost-bytes (segment bytes gone) > other; '' for none."""
    for outcome, marks in (("untyped", ("untyped",)), ("wrong", ("silently wrong", "silently empty")),
                           ("older", ("older epoch", "silently older")), ("lost-bytes", ("segment bytes",))):
        if any(m in p for p in problems for m in marks):
            return outcome
    return "other" if problems else ''


def _epochs(st: Store) -> list[int]:
    try:
        return [i.id for i in st.epochs()]
    except CapsuleError:
        return []


def _facts(st: Store) -> list[str]:
    try:
        return [f"silently wrong: {p}" for p in O.check_facts(st, None, strict=False)]
    except CapsuleError:
        return []
    except Exception as exc:  # noqa: BLE001
        return [f"facts raised untyped {type(exc).__name__}: {exc}"]


def _usable(st: Store, img: Image) -> list[str]:
    e = (st.latest_epoch() or 0) + 1
    try:
        st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e))
        w = O.check_epoch(st, e)
        return [f"after recovering from index damage the new epoch {e} reads back wrong: {w}"] if w else []
    except CapsuleError as exc:
        return [f"after recovering from index damage write_epoch({e}) raised {type(exc).__name__}: {exc}"]


def _refused(folder: Path, img: Image, area: str, intact: list[int], what: str) -> tuple[str, list[str]]:
    if area == "index":
        lost = H.lost_segment_bytes(img.segs, folder, exact=True)
        return ("refused", []) if not lost else ("lost-bytes", [f"{what}, and segment bytes changed: {lost}"])
    if intact and area == "segments":
        return "other", [f"{what} although epochs {intact[-3:]} are intact on disk (independent scan)"]
    return "refused", []


# -- trials -------------------------------------------------------------------------------------------
def trial(img: Image, area: str, seed: int, n: int, work: Path) -> tuple[str, list[str], dict]:
    rng = random.Random(f"{area}/{seed}/{n}")
    folder = work / f"{area}-{img.label}-{seed}-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    H.copy_store(img.folder, folder)
    damage = damage_index if area == "index" else damage_segments
    d = damage(folder, rng)
    outcome, problems = judge(folder, img, area)
    if not problems:
        shutil.rmtree(folder, ignore_errors=True)
    else:   # keep the damaged input as it was before the open, for a post-mortem
        kept = folder.with_name(folder.name + ".input")
        shutil.rmtree(kept, ignore_errors=True)
        H.copy_store(img.folder, kept)
        damage(kept, random.Random(f"{area}/{seed}/{n}"))
        d["kept"] = str(kept)
    return outcome, problems, d


def run_damage(root: Path, area: str, trials: int, *, seed: int = 0, signed_every: int = 4) -> T.Tally:
    """`trials` damages of `area` ("index" or "segments"), over fresh images every 250 trials."""
    tally = T.Tally()
    images: dict = {}
    for n in range(trials):
        s = seed + n // 250
        signed = n % signed_every == signed_every - 1
        if (s, signed) not in images:
            images[(s, signed)] = build_images(root, s, signed)
        power_cut = random.Random(f"image/{s}/{n}").random() < (0.7 if area == "index" else 0.5)
        img = images[(s, signed)][0 if power_cut else 1]
        outcome, problems, d = trial(img, area, s, n, root)
        tally.add(f"{area} damages")
        tally.add(f"{area} {outcome}")
        tally.add(f"damaged {d['file'].split('.', 1)[-1] if area == 'index' else 'seg'}")
        for p in problems:
            recipe = T.describe(family=f"{area} damage", image=img.label, seed=s, trial=n, damage=d,
                                newest_acked=img.newest,
                                replay=f"python -m capsule.tools.bench.reliability_damage {area} {s} {n}"
                                       f"{' --signed' if img.key else ''}{' --clean' if not img.power_cut else ''}")
            where = d["file"].split(".", 1)[-1] if area == "index" else "seg"
            tally.fail(f"{area} damage ({where}): {T.cause_of(p)}", f"{recipe} :: {p}")
    return tally


def main(argv: list[str]) -> int:
    area, seed, n = argv[0], int(argv[1]), int(argv[2])
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="capsule-replay-"))
    pc, clean = build_images(root, seed, "--signed" in argv)
    img = clean if "--clean" in argv else pc
    outcome, problems, d = trial(img, area, seed, n, root)
    print(f"{area} damage {d} on the {img.label} image: {outcome}")
    for p in problems:
        print(" -", p)
    print(f"(folder kept under {root})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
