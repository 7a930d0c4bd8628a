"""The reliability campaign's shared harness: a content model and work folders. Torch-free (the
SIGKILL children import it without capsule/__init__). What writers acknowledged: reliability_ledger;
counts and failures of trials: reliability_tally.

Content model: every page, manifest and fact KV is a pure function of its ids, so a checker knows
the exact bytes of every epoch's view without having seen the writer. Epoch e writes
``pages_for(e)`` with the default base (e - 1); its full view is ``expected_view(e)``.

The oracles that use them are in reliability_oracle.py. Public API only throughout.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...memory.facttable import FactTable
    from ...store import Store


KEEP = 6                 # every workload retains with retain(KEEP)
NAME_EVERY = 20          # epochs whose id is a multiple of this are named (never retained away)
SEGMENT_BYTES = 8192     # small segments: rotation, sealed segments and compaction happen often
KV_SLOTS, STATE_SLOTS, BIG_EVERY = 24, 5, 9
SIGN_KEY = b"reliability-campaign-signing-key"
FACT_PREFIX = "fact #"
MAX_LIVE_FACTS = 24


# -- content model ----------------------------------------------------------------------------------
def page(e: int, region: str, i: int) -> bytes:
    n = {"kv": 384 + (e * 37) % 640, "state": 96, "rng": 16, "big": 5000 + (e * 13) % 700}[region]
    return hashlib.shake_128(f"{e}/{region}/{i}".encode()).digest(n)


def pages_for(e: int) -> list[tuple[str, int, bytes]]:
    out = [("kv", (e - 1) % KV_SLOTS, page(e, "kv", (e - 1) % KV_SLOTS)),
           ("state", e % STATE_SLOTS, page(e, "state", e % STATE_SLOTS)), ("rng", 0, page(e, "rng", 0))]
    if e % BIG_EVERY == 0:   # bigger than a segment's free room: forces a rotation
        out.append(("big", 0, page(e, "big", 0)))
    return out


def writer_of(e: int, region: str, i: int) -> int | None:
    """The epoch (<= e) that last wrote (region, i), or None if none did."""
    if region == "kv":
        x = e - ((e - 1 - i) % KV_SLOTS)
    elif region == "state":
        x = e - ((e - i) % STATE_SLOTS)
    elif region == "rng":
        x = e
    else:
        x = e - e % BIG_EVERY
    return x if x >= 1 else None


def view_keys(e: int) -> list[tuple[str, int, int]]:
    """(region, index, writing epoch) of every page in epoch e's view."""
    keys = [(r, i, writer_of(e, r, i)) for r, n in (("kv", KV_SLOTS), ("state", STATE_SLOTS), ("rng", 1),
                                                   ("big", 1)) for i in range(n)]
    return [(r, i, w) for r, i, w in keys if w is not None]


def expected_view(e: int) -> dict[str, dict[int, bytes]]:
    view: dict[str, dict[int, bytes]] = {}
    for r, i, w in view_keys(e):
        view.setdefault(r, {})[i] = page(w, r, i)
    return view


def manifest(e: int) -> bytes:
    return json.dumps({"epoch": e, "note": "reliability"}).encode()


def epoch_name(e: int) -> str | None:
    return f"named-{e}" if e % NAME_EVERY == 0 else None


def fact_text(seq: int) -> str:
    return f"{FACT_PREFIX}{seq}: the part {seq} sits in bay {seq % 40}"


def fact_seq(text: str) -> int | None:
    if not text.startswith(FACT_PREFIX):
        return None
    head = text[len(FACT_PREFIX):].split(":", 1)[0]
    return int(head) if head.isdigit() and fact_text(int(head)) == text else None


def fact_kv(seq: int, variant: int) -> bytes:
    return b"KV%08d/%04d:" % (seq, variant) + hashlib.shake_128(b"kv%d/%d" % (seq, variant)).digest(
        200 + (seq * 7 + variant) % 300)


def facts(st: Store) -> FactTable:
    """The store's memory facts (torch-free: capsule.memory loads lazily)."""
    from ...memory.facttable import FactTable
    return FactTable(st)


def add_fact(st: Store, seq: int) -> int:
    return facts(st).add_fact(fact_text(seq), tags=["rel", f"s{seq % 7}"], n_tokens=1 + seq % 50,
                              fingerprint="rel-fp", rope="rel-rope", kv=fact_kv(seq, 1))


def set_fact_kv(st: Store, fid: int, seq: int, variant: int) -> None:
    facts(st).set_fact_kv(fid, n_tokens=1 + seq % 50, fingerprint="rel-fp", rope="rel-rope", kv=fact_kv(seq, variant))


# -- folders ----------------------------------------------------------------------------------------
def seg_files(folder: Path) -> dict[str, bytes]:
    seg = folder / "segments"
    return {p.name: p.read_bytes() for p in sorted(seg.glob("*.seg"))} if seg.is_dir() else {}


def kept_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under segments/ and quarantine/ (anywhere in the folder), path -> bytes."""
    out = {}
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if p.is_file() and (rel.parts[0] == "segments" or "quarantine" in rel.parts):
            out[str(rel)] = p.read_bytes()
    return out


def lost_segment_bytes(before: dict[str, bytes], folder: Path, *, exact: bool) -> str:
    """'' when every committed segment's bytes are still in the folder (in segments/ unchanged,
    or grown by appends when not exact; or moved into a quarantine/ folder), else what is lost."""
    now = kept_bytes(folder)
    for name, data in before.items():
        cur = now.get(f"segments/{name}")
        if cur is not None and (cur == data if exact else cur.startswith(data)):
            continue
        if any(k != f"segments/{name}" and "quarantine" in k and v.startswith(data) for k, v in now.items()):
            continue
        what = "is gone" if cur is None else f"changed ({len(data)} -> {len(cur)} bytes)"
        return f"segment {name} ({len(data)} committed bytes) {what}"
    total_before = sum(map(len, before.values()))
    total_now = sum(len(v) for k, v in now.items())
    if total_now < total_before:
        return f"segment bytes shrank: {total_before} committed, {total_now} kept"
    return ""


def fast_root() -> Path:
    """Where trials that do not depend on the disk's own durability (damage, crash states, faults
    injected through FileOps) run: /dev/shm when it is a roomy tmpfs (fsync costs nothing there;
    a SIGKILL or a modeled crash behaves the same), else the temp folder."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > 2 << 30 and os.access(shm, os.W_OK):
            return shm
    except OSError:
        pass
    return Path(tempfile.gettempdir())


def work_dir(name: str, *, prune_after_s: float = 6 * 3600) -> Path:
    """A new, unique folder fast_root()/capsule-reliability/<name>-XXXX (runs may overlap: several
    people run the tests at once). Folders left there by failed runs are pruned after a while."""
    base = fast_root() / "capsule-reliability"
    base.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in base.iterdir():
        try:
            if now - old.stat().st_mtime > prune_after_s:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix=re.sub(r"[^\w.-]+", "_", name)[-100:] + "-", dir=base))


def copy_store(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("LOCK"))
