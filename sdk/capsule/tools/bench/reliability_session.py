"""Damage seen through a Session (model=None, policy builtin:gru): Session.open restores an epoch
whose state is bit-exactly the writer's state at that step; an epoch older than the newest
acknowledged comes with a non-empty Session.restore_report (segment damage) or not at all (index
damage: the newest must come back, or a CapsuleError); nothing restored while epochs exist, or an
untyped exception, is a failure.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

from ...errors import CapsuleError
from . import reliability_harness as H
from . import reliability_tally as T
from .reliability_ledger import Ledger
from .reliability_inject import damage_index, damage_segments
from .reliability_children import open_session, session_digest, session_step

STEPS = 10


def build(root: Path, seed: int, signed: bool) -> tuple[Path, Ledger]:
    path = root / f"session-image-{seed}-{int(signed)}"
    shutil.rmtree(path, ignore_errors=True)
    ledger = Ledger()
    s = open_session(str(path), None, signed)
    try:
        for step in range(STEPS + random.Random(seed).randrange(4)):
            session_step(s, step)
            ledger.line(f"P {step} {session_digest(s)}")
            ledger.line(f"A {s.checkpoint()}")
    finally:
        s.close()
    return path, ledger


def judge(folder: Path, ledger: Ledger, area: str, signed: bool) -> tuple[str, list[str]]:
    try:
        s = open_session(str(folder), None, signed)
    except CapsuleError:
        return "refused", []
    except Exception as exc:  # noqa: BLE001
        return "untyped", [f"Session.open raised untyped {type(exc).__name__}: {exc}"]
    try:
        if s.restored_epoch is None:
            return "wrong", [f"silently empty: Session.open restored nothing while epochs up to {ledger.newest} "
                             f"were acknowledged (restore_report: {s.restore_report[:2]})"]
        step = s.state.get("step")
        if session_digest(s) not in ledger.digests.get(step, set()):
            return "wrong", [f"silently wrong: restored epoch {s.restored_epoch} (step {step}) is not the state "
                             f"the writer checkpointed at that step"]
        if s.restored_epoch == ledger.newest:
            return "recovered", []
        if area == "index":
            return "older", [f"index damage: Session restored older epoch {s.restored_epoch} instead of "
                             f"{ledger.newest} ({'report: ' + s.restore_report[0][:80] if s.restore_report else 'no report'})"]
        if not s.restore_report:
            return "older", [f"silently older: Session restored epoch {s.restored_epoch} (newest acknowledged "
                             f"{ledger.newest}) with an empty restore_report"]
        return "fell-back-reported", []
    finally:
        s.close()


def run_session_damage(root: Path, trials: int, *, seed: int = 0) -> T.Tally:
    tally = T.Tally()
    images: dict = {}
    for n in range(trials):
        area = "segments" if n % 3 else "index"
        signed = n % 5 == 4
        if signed not in images:
            images[signed] = build(root, seed, signed)
        src, ledger = images[signed]
        folder = root / f"session-{area}-{seed}-{n}"
        shutil.rmtree(folder, ignore_errors=True)
        H.copy_store(src, folder)
        damage = damage_index if area == "index" else damage_segments
        d = damage(folder, random.Random(f"session/{seed}/{n}"))
        outcome, problems = judge(folder, ledger, area, signed)
        if problems:   # keep the damaged input as it was before the open
            kept = folder.with_name(folder.name + ".input")
            shutil.rmtree(kept, ignore_errors=True)
            H.copy_store(src, kept)
            damage(kept, random.Random(f"session/{seed}/{n}"))
            d["kept"] = str(kept)
        tally.add("session damages")
        tally.add(f"{'index' if area == 'index' else 'segments'} {outcome}")
        tally.add(f"damaged {d['file'].split('.', 1)[-1] if area == 'index' else 'seg'}")
        for p in problems:
            tally.fail(f"session {area} damage: {T.cause_of(p)}",
                       T.describe(family=f"session {area} damage", seed=seed, trial=n, signed=signed, damage=d)
                       + f" :: {p}")
        if not problems:
            shutil.rmtree(folder, ignore_errors=True)
    return tally
