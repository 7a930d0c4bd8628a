"""Part 1 of `capsule bench --suite fleet`: how fast committed epochs reach S3, and what each one costs.

A replicated Session on the bench model starts from a transcript (its first epoch holds every
page) and grows it by generate(NEW_TOKENS) + checkpoint() per epoch, as fast as this CPU decodes.
The background replicator's MB/s and epochs/s are bytes sent / (first checkpoint -> remote caught
up): when the replicator keeps up, that is the rate epochs were produced, so production_s and
lag_s (last commit -> caught up) are reported beside it. `push` of the same store to a fresh prefix
is the upload path alone: every epoch is there already, nothing waits for a commit.

Bytes are counted on the remote (the sizes of its pack and epoch objects, listed), per epoch: the
replicator's own sent_bytes counts pack bytes only, not the epoch objects.
"""
from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Any

from ...fleet import S3Bucket, push
from ...session import Session
from .timing import progress

NEW_TOKENS = 8                  # as the capsules suite's delta epochs: comparable bytes per epoch
CATCH_UP_TIMEOUT_S = 120.0
_KEY = re.compile(r"(packs|epochs)/(\d{20})[-.]")


def wait_remote(s: Session, timeout: float) -> bool:
    """Until the remote holds the newest epoch, background capsules flushed first (their commit
    is what is waited for); False on timeout or when replication stopped."""
    s.flush()
    return s.wait_replicated(timeout)


def remote_bytes(url: str) -> dict[int, dict[str, int]]:
    """epoch -> {"pack_bytes", "object_bytes"}: what the prefix holds for it (one LIST, no GETs)."""
    out: dict[int, dict[str, int]] = {}
    for key, size in S3Bucket(url).keys(""):
        m = _KEY.match(key)
        if m:
            row = out.setdefault(int(m[2]), {"pack_bytes": 0, "object_bytes": 0})
            row["pack_bytes" if m[1] == "packs" else "object_bytes"] += size
    return out


def grow(s: Session, text: str, epochs: int, show: bool) -> dict[str, Any]:
    """The first (whole) epoch of `text`, then `epochs` deltas; timed to the remote catching up."""
    s.append(text)
    s.generate(1)                                   # prefilled, so the first capsule holds the KV
    t_first = time.perf_counter()                   # from the first checkpoint call (its commit follows)
    first = s.checkpoint()
    bar = progress(epochs, f"replicated epochs (+{NEW_TOKENS} tokens each)", show, unit="epoch")
    for _ in range(epochs):
        s.generate(NEW_TOKENS)
        s.checkpoint()
        bar.update(1)
    bar.close()
    t_last = time.perf_counter()
    caught = wait_remote(s, CATCH_UP_TIMEOUT_S)
    t_done = time.perf_counter()
    st, infos = s.replication, [e for e in s.epochs() if e.id >= first]
    sent = remote_bytes(st.url)
    rows = [{"epoch": e.id, "written": e.bytes_written, **sent.get(e.id, {"pack_bytes": 0, "object_bytes": 0})}
            for e in infos]
    for r in rows:
        r["sent"] = r["pack_bytes"] + r["object_bytes"]
    total = sum(r["sent"] for r in rows)
    span = t_done - t_first
    return {"caught_up": caught, "remote_epoch": st.remote_epoch, "newest_epoch": infos[-1].id,
            "epochs": len(rows), "uploaded": st.uploaded, "skipped": st.skipped,
            "status_sent_bytes": st.sent_bytes, "sent_bytes": total, "written_bytes": sum(r["written"] for r in rows),
            "context_tokens": len(s.tokens()), "seconds": span, "production_s": t_last - t_first,
            "lag_s": t_done - t_last, "mb_s": total / span / 1e6, "epochs_s": len(rows) / span,
            **_per_epoch(rows), "per_epoch": rows}


def _per_epoch(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first epoch (every page) apart from the deltas after it; ratios per epoch, then medians."""
    first, deltas = rows[0], rows[1:] or rows[:1]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in deltas)
    return {"first_written_bytes": first["written"], "first_sent_bytes": first["sent"],
            "first_object_bytes": first["object_bytes"],
            "delta_written_p50": med("written"), "delta_sent_p50": med("sent"),
            "delta_pack_p50": med("pack_bytes"), "delta_object_p50": med("object_bytes"),
            "delta_sent_over_written_p50": statistics.median(r["sent"] / r["written"] for r in deltas),
            "delta_sent_max": max(r["sent"] for r in deltas)}


def one_off_push(store: Path, url: str, sign_key: bytes | None) -> dict[str, Any]:
    """`push` of a closed store to a prefix that holds nothing: every retained epoch, the oldest whole."""
    t0 = time.perf_counter()
    got = push(store, url, sign_key=sign_key)
    seconds = time.perf_counter() - t0
    total = sum(r["pack_bytes"] + r["object_bytes"] for r in remote_bytes(url).values())
    return {"epochs": len(got.uploaded), "sent_bytes": total, "status_sent_bytes": got.sent_bytes,
            "seconds": seconds, "mb_s": total / seconds / 1e6, "epochs_s": len(got.uploaded) / seconds}
