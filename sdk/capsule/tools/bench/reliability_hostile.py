"""Hostile inputs to signed and unsigned stores, and the signing keys.

Forged records (xxh3-tagged in a signed store, HMAC with another key), records of equal length
swapped between epochs, an index row repointed at an older version of a page (record checks all
pass), rows with absurd locations, a record header claiming a 2^60-byte payload, two segment files
swapped by name, an index rolled back to an older copy, a missing / wrong / unexpected signing
key. Each must be refused (a CapsuleError, or an older epoch with a report), or the newest epoch
restored bit-exactly; never a wrong byte, never an untyped exception, never a big allocation.
"""
from __future__ import annotations

import hashlib
import hmac
import random
import resource
import shutil
import sqlite3
import struct
from pathlib import Path

import xxhash

from ...store import SigningKeyError, Store
from . import reliability_harness as H
from . import reliability_tally as T
from .reliability_ledger import Ledger
from .reliability_damage import Image, build_images, judge

REC = struct.Struct("<4sHBBQQHQ")


def record_headers(folder: Path) -> list[tuple[Path, int, tuple]]:
    """(file, offset, header fields) of every record header found by magic (the caller's own images)."""
    out = []
    for p in sorted((folder / "segments").glob("*.seg")):
        data = p.read_bytes()
        off = data.find(b"CREC", 24)
        while off >= 0:
            if off + REC.size <= len(data):
                out.append((p, off, REC.unpack_from(data, off)))
            off = data.find(b"CREC", off + 1)
    return out


def _total(h: tuple) -> int:
    return REC.size + h[6] + h[7] + (32 if h[3] == 2 else 8)


def _newest_page(folder: Path, newest: int):
    for p, off, h in record_headers(folder):
        if h[2] == 1 and h[4] == newest:
            return p, off, h
    return None


def forge_xxh3(folder: Path, img, rng) -> str:
    """A signed store's newest page replaced by an xxh3-tagged record of the same length."""
    found = _newest_page(folder, img.newest)
    if found is None or not img.key:
        return ""
    p, off, h = found
    data = bytearray(p.read_bytes())
    name = bytes(data[off + REC.size:off + REC.size + h[6]])
    payload = bytes(rng.randrange(256) for _ in range(h[7] + 24))    # +24: same total as with HMAC
    head = REC.pack(b"CREC", 1, 1, 1, h[4], h[5], h[6], len(payload)) + name
    rec = head + payload + xxhash.xxh3_64(head + payload).digest()
    data[off:off + len(rec)] = rec
    p.write_bytes(bytes(data))
    return "forge-xxh3"


def forge_wrong_key(folder: Path, img, rng) -> str:
    found = _newest_page(folder, img.newest)
    if found is None or not img.key:   # unsigned: xxh3 catches damage, not forgery (by design)
        return ""
    p, off, h = found
    data = bytearray(p.read_bytes())
    body_end = off + REC.size + h[6] + h[7]
    data[body_end - 5] ^= 0x40                                   # change a payload byte ...
    tag_len = 32 if h[3] == 2 else 8
    body = bytes(data[off:body_end])
    tag = (hmac.new(b"another-key-of-16+bytes", body, hashlib.sha256).digest() if h[3] == 2
           else xxhash.xxh3_64(body).digest())                   # ... and re-tag it (with a wrong key)
    data[body_end:body_end + tag_len] = tag[:tag_len]
    p.write_bytes(bytes(data))
    return "forge-wrong-key"


def swap_records(folder: Path, img, rng) -> str:
    """Two page records of equal length from different epochs swap places."""
    recs = [(p, off, h) for p, off, h in record_headers(folder) if h[2] == 1 and h[6] == 5]   # region "state"
    by_len: dict[int, list] = {}
    for r in recs:
        by_len.setdefault(_total(r[2]), []).append(r)
    pairs = [v for v in by_len.values() if len({x[2][4] for x in v}) > 1]
    if not pairs:
        return ""
    (pa, oa, ha), (pb, ob, hb) = rng.sample(pairs[0], 2)
    la = _total(ha)
    a, b = pa.read_bytes()[oa:oa + la], pb.read_bytes()[ob:ob + la]
    for p, off, blob in ((pa, oa, b), (pb, ob, a)):
        data = bytearray(p.read_bytes())
        data[off:off + la] = blob
        p.write_bytes(bytes(data))
    return "swap-records"


def huge_length(folder: Path, img, rng) -> str:
    found = _newest_page(folder, img.newest)
    if found is None:
        return ""
    p, off, h = found
    data = bytearray(p.read_bytes())
    struct.pack_into("<Q", data, off + 26, 1 << 60)
    p.write_bytes(bytes(data))
    return "header-claims-2^60-bytes"


def rename_segment(folder: Path, img, rng) -> str:
    files = sorted((folder / "segments").glob("*.seg"))
    if len(files) < 2:
        return ""
    a, b = files[-1], files[-2]
    tmp = a.with_suffix(".tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return "segment-files-swapped"


def _sql(folder: Path, statements: list[str]) -> str:
    conn = sqlite3.connect(folder / "index.sqlite")
    try:
        for s in statements:
            conn.execute(s)
        conn.commit()
        return "ok"
    except sqlite3.Error:
        return ""
    finally:
        conn.close()


def row_to_older_page(folder: Path, img, rng) -> str:
    """The newest epoch's kv page row now names an older, intact record of the same page (its
    rec_epoch edited to match): a rollback of one page that every record check passes."""
    e = img.newest
    slot = (e - 1) % H.KV_SLOTS
    older = [(p, off, h) for p, off, h in record_headers(folder) if h[2] == 1 and h[5] == slot and h[6] == 2 and h[4] < e]
    if not older:
        return ""
    p, off, h = older[-1]
    ok = _sql(folder, [f"UPDATE pages SET rec_epoch={h[4]}, segment={int(p.stem)}, offset={off}, length={_total(h)} "
                       f"WHERE region='kv' AND idx={slot} AND epoch={e}"])
    return "index-row-to-older-page" if ok else ""


def absurd_row(folder: Path, img, rng) -> str:
    value = rng.choice(["offset=-5", "length=1099511627776", "segment=999999", "offset=9223372036854775807",
                        "length=0", "segment=NULL, offset=NULL, length=NULL"])
    ok = _sql(folder, [f"UPDATE pages SET {value} WHERE epoch=(SELECT MAX(epoch) FROM pages)"])
    return f"index-row-{value.split('=')[0]}" if ok else ""


HOSTILE = (forge_xxh3, forge_wrong_key, swap_records, huge_length, rename_segment, row_to_older_page, absurd_row)


def run_hostile(work: Path, *, rounds: int = 2, seed: int = 0) -> T.Tally:
    tally = T.Tally()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for r in range(rounds):
        for signed in (False, True):
            pc, clean = build_images(work, seed + 100 + r, signed)
            for img in (clean, pc):
                for n, attack in enumerate(HOSTILE):
                    rng = random.Random(f"hostile/{seed}/{r}/{n}")
                    folder = work / f"hostile-{r}-{img.label}-{attack.__name__}"
                    shutil.rmtree(folder, ignore_errors=True)
                    H.copy_store(img.folder, folder)
                    name = attack(folder, img, rng)
                    if not name:
                        continue
                    _judge(folder, img, name, tally)
            tally.merge(_rollback(work, seed + 200 + r, signed))
            tally.merge(_keys(pc))
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    if grew > 200 << 10:
        tally.fail("hostile inputs: peak RSS grew by over 200 MiB (an allocation driven by a hostile length?)",
                   T.describe(family="hostile", grew_kib=grew))
    return tally


def _judge(folder: Path, img, name: str, tally: T.Tally) -> None:
    outcome, problems = judge(folder, img, "hostile")
    tally.add("hostile inputs")
    tally.add("hostile inputs refused" if outcome in ("refused", "fell-back-reported") else f"hostile {outcome}")
    for p in problems:
        tally.fail(f"hostile input ({name}): {T.cause_of(p)}",
                   T.describe(family="hostile", attack=name, image=img.label, kept=str(folder)) + f" :: {p}")
    if not problems:
        shutil.rmtree(folder, ignore_errors=True)


def _rollback(work: Path, seed: int, signed: bool) -> T.Tally:
    """index.sqlite replaced by a copy taken 5 epochs earlier (segments are newer than the index)."""
    tally = T.Tally()
    key = H.SIGN_KEY if signed else None
    path = work / f"rollback-{seed}-{int(signed)}"
    shutil.rmtree(path, ignore_errors=True)
    old = work / f"rollback-old-{seed}-{int(signed)}"
    shutil.rmtree(old, ignore_errors=True)
    st = Store.open(path, segment_bytes=H.SEGMENT_BYTES, sign_key=key)
    for e in range(1, 21):
        st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e))
        if e == 15:
            st.close()
            H.copy_store(path, old)
            st = Store.open(path, segment_bytes=H.SEGMENT_BYTES, sign_key=key)
    st.close()
    segs = H.seg_files(path)
    for n in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (path / n).unlink(missing_ok=True)
        if (old / n).exists():
            shutil.copy(old / n, path / n)
    img = Image(path, False, key, list(range(1, 21)), Ledger(acked=set(range(1, 21))), segs)
    _judge_index(path, img, tally)
    return tally


def _judge_index(folder: Path, img, tally: T.Tally) -> None:
    outcome, problems = judge(folder, img, "index")
    tally.add("hostile inputs")
    tally.add("hostile inputs refused" if outcome == "refused" else f"hostile {outcome}")
    for p in problems:
        tally.fail(f"hostile input (index-rolled-back): {T.cause_of(p)}",
                   T.describe(family="hostile", attack="index-rolled-back", signed=img.key is not None,
                              kept=str(folder)) + f" :: {p}")


def _keys(img) -> T.Tally:
    """Opening with no key, another key, or a key for an unsigned store: SigningKeyError."""
    tally = T.Tally()
    tries = ([None, b"another-key-of-16+bytes"] if img.key else [H.SIGN_KEY])
    for key in tries:
        tally.add("hostile inputs")
        try:
            Store.open(img.folder, sign_key=key).close()
            tally.fail("hostile input (wrong signing key): the store opened",
                       T.describe(family="hostile", attack="wrong-key", image=img.label))
        except SigningKeyError:
            tally.add("hostile inputs refused")
        except Exception as exc:  # noqa: BLE001
            tally.fail(f"hostile input (wrong signing key): raised {type(exc).__name__}, not SigningKeyError",
                       T.describe(family="hostile", attack="wrong-key", image=img.label) + f" :: {exc}")
    return tally

