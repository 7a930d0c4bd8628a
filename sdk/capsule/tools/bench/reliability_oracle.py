"""The kill oracle and the exactness checks shared by every family of trials (public API only).

check_store(path, ledger): reopen never raises; every acknowledged epoch that retention would keep
is present; the newest epoch is >= the newest acknowledged; every epoch loads bit-exactly;
acknowledged facts are present with their exact KV bytes, acknowledged forgets stay forgotten;
verify() is clean; and the store takes one more epoch.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from ...errors import CapsuleError
from ...memory.facterrors import UnknownFact
from ...store import Store
from . import reliability_harness as H
from .reliability_harness import SEGMENT_BYTES, epoch_name, expected_view, fact_kv, fact_seq, manifest, pages_for
from .reliability_ledger import Ledger, span


# -- checks -----------------------------------------------------------------------------------------
def diff_view(got: dict, want: dict) -> str:
    """'' when equal, else the first difference, for a failure message."""
    if got == want:
        return ""
    for r in sorted(set(got) | set(want)):
        g, w = got.get(r, {}), want.get(r, {})
        for i in sorted(set(g) | set(w)):
            if g.get(i) != w.get(i):
                gl = None if g.get(i) is None else len(g[i])
                wl = None if w.get(i) is None else len(w[i])
                return f"page {r}[{i}] differs (got {gl} bytes, want {wl} bytes)"
    return "views differ"


def check_epoch(st: Store, e: int) -> str:
    """'' when load_epoch(e) is exact; a typed refusal is returned as 'refused: ...'."""
    try:
        man, pages = st.load_epoch(e)
    except CapsuleError as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    if bytes(man) != manifest(e):
        return f"epoch {e}: manifest bytes differ ({bytes(man)[:60]!r})"
    why = diff_view(pages, expected_view(e))
    return f"epoch {e}: {why}" if why else ""


def check_facts(st: Store, ledger: Ledger | None, *, strict: bool) -> list[str]:
    """Every fact handed out has exact KV bytes; with strict (kills, crash states): acknowledged
    facts are present and acknowledged forgets stay forgotten."""
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = H.facts(st).facts()
    if strict and caught:
        problems.append(f"facts(): warnings {[str(w.message)[:120] for w in caught]}")
    present = {f.id: f for f in infos}
    for fid, info in present.items():
        seq = fact_seq(info.text)
        if seq is None:
            problems.append(f"fact {fid}: unknown text {info.text[:60]!r}")
            continue
        try:
            kv = H.facts(st).fact_kv(fid)
        except CapsuleError as exc:
            if strict:
                problems.append(f"fact {fid}: fact_kv raised {type(exc).__name__}: {exc}")
            continue
        top = ledger.kv_tried.get(fid, 1) if ledger else 1 << 12
        low = ledger.kv_acked.get(fid, 1) if ledger else 1
        if ledger is not None and top < low:
            top = low
        variant = _variant_of(kv, seq)
        if variant is None or not low <= variant <= top:
            problems.append(f"fact {fid} (seq {seq}): KV bytes are not a KV it was given "
                            f"(variant {variant}, allowed {low}..{top})")
    if strict and ledger is not None:
        for fid, seq in ledger.facts.items():
            if fid not in ledger.forget_tried and fid not in present:
                problems.append(f"acknowledged fact {fid} (seq {seq}) is missing")
        for fid in ledger.forgotten:
            if fid in present:
                problems.append(f"fact {fid} was forgotten (acknowledged) but is back")
            else:
                try:
                    H.facts(st).fact_kv(fid)
                    problems.append(f"fact {fid} was forgotten (acknowledged) but fact_kv still reads it")
                except UnknownFact:
                    pass
                except CapsuleError as exc:
                    problems.append(f"forgotten fact {fid}: fact_kv raised {type(exc).__name__}, not UnknownFact")
        damaged = H.facts(st).damaged_facts()
        if damaged:
            problems.append(f"damaged facts after a kill: {damaged[:4]}")
    return problems


def _variant_of(kv: bytes, seq: int) -> int | None:
    head = kv[:48].split(b":", 1)[0]
    try:
        s, v = head[2:].split(b"/")
        s_i, v_i = int(s), int(v)
    except ValueError:
        return None
    return v_i if s_i == seq and kv == fact_kv(seq, v_i) else None


def check_store(path: Path, ledger: Ledger, *, sign_key: bytes | None = None, usable: bool = True,
                verify: bool = True, notes: list[str] | None = None) -> list[str]:
    """The kill oracle: reopen never raises; every acknowledged epoch retention would keep is
    present; the newest is >= the newest acknowledged; every epoch loads bit-exactly; facts as
    acknowledged. usable: then write the next epoch and read it back (it joins the ledger)."""
    problems: list[str] = []
    try:
        st = Store.open(path, sign_key=sign_key, segment_bytes=SEGMENT_BYTES)
    except Exception as exc:  # noqa: BLE001 - the oracle classifies everything
        return [f"reopen raised {type(exc).__name__}: {exc}"]
    if notes is not None:   # what recovery did at open (Store.recovery_report, where the store keeps one)
        notes += list(getattr(st, "recovery_report", None) or [])
    try:
        problems += _check_open_store(st, ledger, verify)
        if usable and not problems:
            e = (st.latest_epoch() or 0) + 1
            try:
                info = st.write_epoch(pages_for(e), manifest(e), name=epoch_name(e))
                if info.id != e:
                    problems.append(f"after recovery write_epoch got id {info.id}, expected {e}")
                else:
                    ledger.acked.add(e)
                    why = check_epoch(st, e)
                    if why:
                        problems.append(f"after recovery the new epoch {e} reads back wrong: {why}")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"after recovery write_epoch({e}) raised {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"checking raised {type(exc).__name__}: {exc}")
    finally:
        try:
            st.close()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"close raised {type(exc).__name__}: {exc}")
    return problems


def _check_open_store(st: Store, ledger: Ledger, verify: bool) -> list[str]:
    problems = []
    ids = [e.id for e in st.epochs()]
    latest = st.latest_epoch() or 0
    missing = sorted(ledger.must_have() - set(ids))
    if missing:
        problems.append(f"acknowledged epochs lost: {missing[:10]} (store holds {span(ids)})")
    if latest < ledger.newest:
        problems.append(f"newest epoch {latest} < newest acknowledged {ledger.newest}")
    try:
        found = st.load_newest_valid()
    except Exception as exc:  # noqa: BLE001
        return problems + [f"load_newest_valid raised {type(exc).__name__}: {exc}"]
    if found is None:
        if ledger.acked:
            problems.append(f"load_newest_valid() is None but epochs up to {ledger.newest} were acknowledged")
    else:
        epoch, man, pages, skipped = found
        if epoch < ledger.newest:
            problems.append(f"restored epoch {epoch} < newest acknowledged {ledger.newest}")
        if skipped:
            problems.append(f"restore skipped epochs after a kill: {skipped[:3]}")
        why = diff_view(pages, expected_view(epoch)) or ("manifest differs" if bytes(man) != manifest(epoch) else "")
        if why:
            problems.append(f"restored epoch {epoch} is not bit-exact: {why}")
    for e in ids:
        why = check_epoch(st, e)
        if why:
            problems.append(f"epoch {e} does not load exactly: {why}")
    problems += check_facts(st, ledger, strict=True)
    if verify:
        report = st.verify()
        if not report.ok:
            problems.append(f"verify() after a kill: {list(report.problems)[:3]}")
    return problems
