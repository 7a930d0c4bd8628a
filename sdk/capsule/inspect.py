"""`capsule inspect` and `capsule verify`: read a capsule store without loading any model."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .errors import StoreError
from .store import Store


def _open_existing(path: str | os.PathLike) -> Store:
    if not Path(path).is_dir():
        raise StoreError(f"{str(path)!r} is not a capsule store folder")
    return Store.open(path, create=False)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def inspect_store(path: str | os.PathLike) -> str:
    """Epochs, sizes, and for the newest epoch its fingerprints, regions and streams."""
    with _open_existing(path) as store:
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


def verify_store(path: str | os.PathLike) -> tuple[bool, str]:
    """Read and check every record; (ok, report)."""
    with _open_existing(path) as store:
        report = store.verify()
    lines = [f"verify {path}: {'OK' if report.ok else 'DAMAGED'} — {report.records} records, "
             f"{report.bytes} bytes; epochs ok: {len(report.epochs_ok)}, bad: {len(report.epochs_bad)}"]
    if report.epochs_bad:
        lines.append(f"  bad epochs: {', '.join(map(str, report.epochs_bad))}")
    if report.facts_bad:
        lines.append(f"  damaged memory facts (never injected): {', '.join(map(str, report.facts_bad))}")
    lines += [f"  problem: {p}" for p in report.problems]
    return report.ok, "\n".join(lines)
