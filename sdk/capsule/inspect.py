"""`capsule inspect` and `capsule verify`: read a capsule store without loading any model."""
from __future__ import annotations

import json
import os
import stat
import time
import warnings
from pathlib import Path

from .errors import CapsuleCorrupt, StoreError
from .memory.encode import HEADER as _FACTKV_HEADER
from .memory.encode import ITEM_BYTES as _FACTKV_ITEM_BYTES
from .memory.encode import MAGIC as _FACTKV_MAGIC
from .memory.encode import VERSION as _FACTKV_VERSION
from .store import Store
from .store.errors import DamagedFactWarning, SigningKeyError
from .store.store import holds_store

# A memory fact's KV bytes start with the FactKV header of memory/encode.py (its format constants
# are imported, not copied; only the header is parsed here): magic, version, dtype code, L, T,
# KV, hd, crc32

SIGN_KEY_ENV = "CAPSULE_SIGN_KEY_FILE"
_MAX_KEY_FILE = 1 << 20
_KEY_HINT = f"give its key file with --sign-key-file PATH or the {SIGN_KEY_ENV} environment variable"


def read_sign_key(option: str | None) -> tuple[bytes | None, str]:
    """(key, where it came from) for inspect/verify: the file named by --sign-key-file, else by
    $CAPSULE_SIGN_KEY_FILE, else (None, ""). The file holds the key's raw bytes (no trailing newline
    is stripped); an empty, too short, or other-readable file is refused."""
    if option:
        path, source = option, f"--sign-key-file {option}"
    elif os.environ.get(SIGN_KEY_ENV):
        path = os.environ[SIGN_KEY_ENV]
        source = f"{SIGN_KEY_ENV}={path}"
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


def _open_existing(path: str | os.PathLike, sign_key: bytes | None = None, source: str = "") -> Store:
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
    """Epochs, sizes, and for the newest epoch its fingerprints, regions and streams.
    sign_key: a signed store's key (source: where it came from, for messages)."""
    with _open_existing(path, sign_key, source) as store:
        stats = store.stats()
        epochs = store.epochs()
        lines = [f"store {path}: {len(epochs)} epoch(s), {stats['segments']} segment(s), "
                 f"{stats['bytes_on_disk'] / 2**20:.2f} MiB on disk, {stats['live_bytes'] / 2**20:.2f} MiB live, "
                 f"{stats.get('facts', 0)} memory fact(s)"]
        if not epochs:
            return "\n".join(lines + ["(no epochs yet)"])
        lines.append(f"{'epoch':>6} {'name':<12} {'created (UTC)':<20} {'bytes':>10} {'pages':>6} {'base':>5}  streams")
        for e in epochs:
            streams = ", ".join(f"{k}:{v}" for k, v in (e.meta.get("streams") or {}).items())
            lines.append(f"{e.id:>6} {(e.name or '-'):<12} {_when(e.created):<20} {e.bytes_written:>10} "
                         f"{e.n_pages:>6} {e.base or '-':>5}  {streams or '-'}")
        newest = epochs[-1].id
        manifest, pages = store.load_epoch(newest)
    doc = json.loads(manifest)
    lines.append(f"\nnewest epoch {newest}")
    for key, value in doc.get("binding", {}).items():
        lines.append(f"  binding.{key}: {value}")
    for region in sorted(pages):
        n = len(pages[region])
        lines.append(f"  region {region}: {n} page(s), {sum(len(p) for p in pages[region].values())} bytes")
    for s in doc.get("host", {}).get("streams", []):
        region = s.get("region")
        mem = ""
        if isinstance(region, dict):   # shown as saved; a restore range-checks it
            facts = [f[0] for f in region.get("facts") or [] if isinstance(f, list) and f]
            mem = f", memory region of {region.get('size')} positions with facts {facts}"
        lines.append(f"  stream {s['name']!r}: {s['n_ids']} tokens, {s['num_cached']} with KV cached{mem}")
    app = doc.get("host", {}).get("app_state") or {}
    lines.append(f"  app state keys: {', '.join(sorted(app)) or '-'}")
    return "\n".join(lines)


def verify_store(path: str | os.PathLike, sign_key: bytes | None = None,
                 source: str = "") -> tuple[bool, str]:
    """Read and check every record, and every memory fact (its row, its text binding, its FactKV
    header against the row); (ok, report). sign_key, source: as for inspect_store."""
    with _open_existing(path, sign_key, source) as store:
        report = store.verify()
        damaged = _fact_damage(store, set(report.facts_bad))
    ok = report.ok and not damaged
    facts_bad = sorted(set(report.facts_bad) | {fid for fid, _ in damaged})
    lines = [f"verify {path}: {'OK' if ok else 'DAMAGED'} — {report.records} records, "
             f"{report.bytes} bytes; epochs ok: {len(report.epochs_ok)}, bad: {len(report.epochs_bad)}"]
    if report.epochs_bad:
        lines.append(f"  bad epochs: {', '.join(map(str, report.epochs_bad))}")
    if facts_bad:
        lines.append(f"  damaged memory facts (never injected): {', '.join(map(str, facts_bad))}; "
                     f"forget them (Session.forget) and remember them again")
    lines += [f"  problem: {p}" for p in report.problems]
    lines += [f"  problem: fact {fid}: {why}" for fid, why in damaged]
    return ok, "\n".join(lines)


def _fact_damage(store: Store, record_bad: set[int]) -> list[tuple[int, str]]:
    """(id, why) for every fact whose text is not the one its KV was encoded from, or whose KV
    is not a FactKV agreeing with its row. Damaged rows and damaged records are in the store's
    own verify report (record_bad) already: not read again."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedFactWarning)   # Store.verify lists damaged rows
        infos = store.facts()
    for info in infos:
        if info.id in record_bad:
            continue
        try:
            why = _factkv_problem(store.fact_kv(info.id), info.n_tokens)
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
