"""`capsule inspect` and `capsule verify`: read a capsule store without loading any model."""
from __future__ import annotations

import os
import stat
import time
import warnings
from pathlib import Path

from ..errors import CapsuleCorrupt, CapsuleError, StoreError
from ..memory.encode import HEADER as _FACTKV_HEADER
from ..memory.encode import ITEM_BYTES as _FACTKV_ITEM_BYTES
from ..memory.encode import MAGIC as _FACTKV_MAGIC
from ..memory.encode import VERSION as _FACTKV_VERSION
from .. import safejson
from ..state.manifest import MAX_MANIFEST_BYTES, EpochCorrupt, Limits, Manifest, parse
from ..store import Store, quarantine
from ..memory.facterrors import DamagedFactWarning
from ..memory.facttable import FactTable
from ..store.errors import PageCorrupt, SigningKeyError
from ..store.folder import holds_store

# A memory fact's KV bytes start with the FactKV header of memory/encode.py (its format constants
# are imported, not copied; only the header is parsed here): magic, version, dtype code, L, T,
# KV, hd, crc32

SIGN_KEY_ENV = "CAPSULE_SIGN_KEY_FILE"
_MAX_KEY_FILE = 1 << 20
_KEY_HINT = f"give its key file with --sign-key-file PATH or the {SIGN_KEY_ENV} environment variable"


def read_sign_key(option: str | None, env: str = SIGN_KEY_ENV, flag: str = "--sign-key-file"
                  ) -> tuple[bytes | None, str]:
    """(key, where it came from) for inspect/verify: the file named by --sign-key-file, else by
    $CAPSULE_SIGN_KEY_FILE, else (None, ""). The file holds the key's raw bytes (no trailing newline
    is stripped); an empty, too short, or other-readable file is refused. env / flag: another
    key's variable and option (the fleet key: CAPSULE_FLEET_KEY_FILE, --fleet-key-file)."""
    if option:
        path, source = option, f"{flag} {option}"
    elif os.environ.get(env):
        path = os.environ[env]
        source = f"{env}={path}"
    else:
        return None, ""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read(_MAX_KEY_FILE + 1)
    except OSError as exc:
        raise SigningKeyError(f"cannot read the signing key file ({source}): {exc.strerror or exc}; "
                              f"give a readable file holding the key's raw bytes") from None
    if len(key) > _MAX_KEY_FILE:
        raise SigningKeyError(f"signing key file {path!r} ({source}) is over {_MAX_KEY_FILE} bytes; give "
                              f"the file holding just the key's raw bytes")
    if mode & 0o006:
        raise SigningKeyError(f"signing key file {path!r} ({source}) can be read or written by other users "
                              f"(mode {stat.S_IMODE(mode):04o}); restrict it: chmod 600 {path}")
    if not key:
        raise SigningKeyError(f"signing key file {path!r} ({source}) is empty; it must hold the key's raw "
                              f"bytes, the sign_key the store was created with")
    if len(key) < 16:
        raise SigningKeyError(f"signing key file {path!r} ({source}) holds {len(key)} bytes; a signing key "
                              f"is at least 16 bytes (the key's raw bytes, as the store was created with)")
    return key, source


def open_existing(path: str | os.PathLike, sign_key: bytes | None = None, source: str = "") -> Store:
    """Open a store that must already exist (the CLI's verbs never create one); typed errors."""
    folder = Path(path)
    if not folder.is_dir():
        raise StoreError(f"{str(path)!r} is not a capsule store folder")
    if not holds_store(folder):
        raise StoreError(f"{str(path)!r} holds no capsule store (no index.sqlite or segment files); "
                         f"give the folder a Session or Store wrote")
    try:
        return Store.open(folder, create=False, sign_key=sign_key)
    except SigningKeyError as exc:
        hint = f"the key came from {source}" if sign_key is not None else _KEY_HINT
        raise SigningKeyError(f"{exc} ({hint})") from exc
    except OSError as exc:  # e.g. EROFS / EACCES taking the LOCK
        where = f" ({exc.filename})" if exc.filename else ""
        raise StoreError(f"cannot open store {str(path)!r}: {exc.strerror or exc}{where}; inspect and verify "
                         f"take the store's LOCK and recover it, so they need write access to the folder "
                         f"(on a read-only disk, copy the folder to a writable one)") from exc


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def inspect_store(path: str | os.PathLike, sign_key: bytes | None = None, source: str = "") -> str:
    """inspect_report's text (see there)."""
    return inspect_report(path, sign_key, source)[1]


def inspect_report(path: str | os.PathLike, sign_key: bytes | None = None,
                   source: str = "") -> tuple[bool, str]:
    """(ok, text): epochs, sizes, and for the newest readable epoch its fingerprints, regions and
    streams. An epoch whose manifest or pages cannot be read gets one line saying why (ok False).
    sign_key: a signed store's key (source: where it came from, for messages)."""
    with open_existing(path, sign_key, source) as store:
        stats = store.stats()
        epochs = store.epochs()
        lines = [f"store {path}: {len(epochs)} epoch(s), {stats['segments']} segment(s), "
                 f"{stats['bytes_on_disk'] / 2**20:.2f} MiB on disk, {stats['live_bytes'] / 2**20:.2f} MiB live, "
                 f"{FactTable(store).count_facts()} memory fact(s)"]
        aside = quarantine.events(Path(path))
        if aside:
            lines.append(f"quarantine/: {len(aside)} folder(s) recovery set aside (never read again; inspect or "
                         f"delete them); newest {aside[-1][0]}: {aside[-1][1]}")
        if not epochs:
            return True, "\n".join(lines + ["(no epochs yet)"])
        lines.append(f"{'epoch':>6} {'name':<12} {'created (UTC)':<20} {'bytes':>10} {'pages':>6} {'base':>5}  streams")
        for e in epochs:
            named = e.meta.get("streams")
            streams = ", ".join(f"{k}:{v}" for k, v in named.items()) if isinstance(named, dict) else ""
            lines.append(f"{e.id:>6} {(e.name or '-'):<12} {_when(e.created):<20} {e.bytes_written:>10} "
                         f"{e.n_pages:>6} {e.base or '-':>5}  {streams or '-'}")
        parsed, problems = _check_manifests(store, [e.id for e in epochs])
        newest = max(parsed) if parsed else None
        pages: dict | None = None
        if newest is not None:
            try:
                _, pages = store.load_epoch(newest, max_page_bytes=INSPECT_MAX_PAGE_BYTES)
            except CapsuleError as exc:
                problems.append(f"epoch {newest}: pages unreadable: {_one_line(exc)} (run `capsule verify`)")
    lines += [f"damaged: {p}" for p in problems]
    if newest is not None:
        lines += _describe(parsed[newest], pages, newest == epochs[-1].id)
    return not problems, "\n".join(lines)


# inspect knows no layout: a page above this (a KV block of a very large model is a few MiB) is
# refused before it is read
INSPECT_MAX_PAGE_BYTES = 64 << 20


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _manifests(store: Store, ids: list[int]) -> dict[int, bytes]:
    """Every epoch's manifest bytes, reading no page. (An epoch whose manifest record is damaged
    is missing here; Store.verify reports it.)"""
    seen: dict[int, bytes] = {}
    for epoch in ids:
        try:
            seen[epoch] = store.load_manifest(epoch, max_bytes=MAX_MANIFEST_BYTES)
        except PageCorrupt:
            continue
    return seen


def _check_manifests(store: Store, ids: list[int]) -> tuple[dict[int, Manifest], list[str]]:
    """The epochs whose manifest parses as a Session capsule (no layout known: its shape and
    generic bounds), and a line per epoch whose manifest does not. A store where no epoch even
    claims to be a Session capsule (written through Store directly: manifests are opaque bytes
    to the store) has nothing to check here."""
    raw = _manifests(store, ids)
    parsed: dict[int, Manifest] = {}
    problems = []
    for epoch in ids:
        if epoch not in raw:
            problems.append(f"epoch {epoch}: manifest record unreadable (run `capsule verify`)")
            continue
        try:
            parsed[epoch] = parse(epoch, raw[epoch], Limits())
        except EpochCorrupt as exc:
            problems.append(f"epoch {epoch}: {exc.detail}")
    if not parsed and not any(_claims_session(data) for data in raw.values()):
        return {}, [p for p in problems if "manifest record unreadable" in p]
    return parsed, problems


def _claims_session(data: bytes) -> bool:
    try:
        doc = safejson.loads(data, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    except ValueError:
        return False
    return isinstance(doc, dict) and "binding" in doc


def _describe(m: Manifest, pages: dict | None, is_newest: bool) -> list[str]:
    lines = [f"\n{'newest' if is_newest else 'newest readable'} epoch {m.epoch}"]
    b = m.binding
    for key in ("format_version", "model", "tokenizer", "layout", "dtype", "device_class"):
        lines.append(f"  binding.{key}: {getattr(b, key)}")
    for key in ("model", "tokenizer"):
        if key in b.labels:
            lines.append(f"  {key} name: {b.labels[key]}")
    layout = b.labels.get("layout") or {}
    if layout:
        lines.append("  layout settings: " + ", ".join(f"{k}={v}" for k, v in sorted(layout.items())))
    for region in sorted(pages or {}):
        n = len(pages[region])
        lines.append(f"  region {region}: {n} page(s), {sum(len(p) for p in pages[region].values())} bytes")
    for s in m.host["streams"]:
        region, mem = s.get("region"), ""
        if isinstance(region, dict):   # shown as saved; a restore range-checks it
            raw = region.get("facts")
            facts = [f[0] for f in raw if isinstance(f, list) and f] if isinstance(raw, list) else []
            mem = f", memory region of {region.get('size')!r} positions with facts {facts[:20]}"
        lines.append(f"  stream {s['name']!r}: {s['n_ids']} tokens, {s['num_cached']} with KV cached{mem}")
    app = sorted(m.host["app_state"])
    lines.append(f"  app state keys: {', '.join(app[:20]) or '-'}" + (f" (+{len(app) - 20} more)" if len(app) > 20 else ""))
    return lines


def verify_store(path: str | os.PathLike, sign_key: bytes | None = None,
                 source: str = "") -> tuple[bool, str]:
    """Read and check every record, every epoch's manifest (its shape), and every memory fact (its
    row, its text binding, its FactKV header against the row); (ok, report). sign_key, source: as
    for inspect_store."""
    with open_existing(path, sign_key, source) as store:
        report = store.verify()
        damaged = _fact_damage(store, {rid for coll, rid in report.records_bad if coll == "fact"})
        # epochs whose manifest record is bad are in the report already: only the readable ones
        _, manifest_bad = _check_manifests(store, [e for e in report.epochs_ok])
    ok = report.ok and not damaged and not manifest_bad
    facts_bad = sorted({rid for coll, rid in report.records_bad if coll == "fact"} | {fid for fid, _ in damaged})
    lines = [f"verify {path}: {'OK' if ok else 'DAMAGED'} — {report.records} records, "
             f"{report.bytes} bytes; epochs ok: {len(report.epochs_ok) - len(manifest_bad)}, "
             f"bad: {len(report.epochs_bad) + len(manifest_bad)}"]
    if report.epochs_bad:
        lines.append(f"  bad epochs: {', '.join(map(str, report.epochs_bad))}")
    if facts_bad:
        lines.append(f"  damaged memory facts (never injected): {', '.join(map(str, facts_bad))}; "
                     f"forget them (Session.forget) and remember them again")
    lines += [f"  problem: {p}" for p in report.problems]
    lines += [f"  problem: {p} (a Session skips this epoch)" for p in manifest_bad]
    lines += [f"  problem: fact {fid}: {why}" for fid, why in damaged]
    return ok, "\n".join(lines)


def _fact_damage(store: Store, record_bad: set[int]) -> list[tuple[int, str]]:
    """(id, why) for every fact whose row breaks a fact's limits, whose text is not the one its KV
    was encoded from, or whose KV is not a FactKV agreeing with its row. Damaged records are in
    the store's own verify report (record_bad) already: not read again."""
    table = FactTable(store)
    out = [(fid, f"index row: {why}") for fid, why in table.damaged_facts() if fid not in record_bad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedFactWarning)   # listed just above
        infos = table.facts()
    for info in infos:
        if info.id in record_bad:
            continue
        try:
            why = _factkv_problem(table.fact_kv(info.id), info.n_tokens)
        except CapsuleCorrupt as exc:
            why = getattr(exc, "reason", str(exc))
        if why:
            out.append((info.id, why))
    return sorted(out)


def _factkv_problem(data: bytes, n_tokens: int) -> str:
    """'' when data starts with a FactKV header agreeing with its length and the row's n_tokens."""
    if len(data) < _FACTKV_HEADER.size:
        return f"KV is {len(data)} bytes, shorter than a FactKV header ({_FACTKV_HEADER.size})"
    magic, version, code, layers, tokens, heads, head_dim, _ = _FACTKV_HEADER.unpack_from(data)
    if magic != _FACTKV_MAGIC or version != _FACTKV_VERSION or code not in _FACTKV_ITEM_BYTES:
        return (f"KV is not a FactKV (magic {magic!r}, version {version}, dtype code {code}; expected "
                f"{_FACTKV_MAGIC!r}, version {_FACTKV_VERSION})")
    want = _FACTKV_HEADER.size + 2 * layers * tokens * heads * head_dim * _FACTKV_ITEM_BYTES[code]
    if len(data) != want:
        return f"KV is {len(data)} bytes; its FactKV header (L={layers}, T={tokens}, KV={heads}, hd={head_dim}) " \
               f"implies {want}"
    if tokens != n_tokens:
        return f"KV header holds T={tokens} tokens; its row says n_tokens={n_tokens}"
    return ""
