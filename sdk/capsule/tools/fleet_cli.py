"""`capsule pull | push` and `capsule inspect s3://...`: the fleet verbs' work and their reports."""
from __future__ import annotations

import sys
import time
from typing import Callable

from ..fleet import RemoteCorrupt, pull, push, remote_epochs
from .store_report import read_sign_key

FLEET_KEY_ENV = "CAPSULE_FLEET_KEY_FILE"


def fleet_key(option: str | None) -> bytes | None:
    return read_sign_key(option, FLEET_KEY_ENV, "--fleet-key-file")[0]


def inspect_remote(url: str, key_file: str | None) -> tuple[bool, str]:
    """(ok, text): the replica's store and every remote epoch (or why it cannot be read)."""
    store_id, epochs = remote_epochs(url, sign_key=fleet_key(key_file))
    lines = [f"replica {url}: store {store_id}, {len(epochs)} epoch(s)"]
    if not epochs:
        return True, "\n".join(lines + ["(no epochs yet)"])
    lines.append(f"{'epoch':>6} {'name':<12} {'created (UTC)':<20} {'pages':>6} {'bytes':>12}  streams")
    ok = True
    for e in epochs:
        if isinstance(e, RemoteCorrupt):
            ok = False
            lines.append(f"{'?':>6} {e}")
            continue
        named = e.meta.get("streams")
        streams = ", ".join(f"{k}:{v}" for k, v in named.items()) if isinstance(named, dict) else "-"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.created))
        lines.append(f"{e.epoch:>6} {(e.name or '-'):<12} {when:<20} {e.n_pages:>6} {e.page_bytes:>12}  {streams}")
    return ok, "\n".join(lines)


def run_pull(url: str, dest: str, epoch: str | None, key_file: str | None, store_key: bytes | None) -> str:
    got = pull(url, dest, epoch=epoch, sign_key=fleet_key(key_file), store_key=store_key, progress=_bar("pull"))
    return (f"pulled epoch {got.epoch} of {url} into {dest} (its epoch {got.local_epoch}): {got.pages} pages, "
            f"{got.page_bytes / 2**20:.2f} MiB in {got.seconds:.2f} s; Session.open({dest!r}, ...) restores it")


def run_push(store: str, url: str, key_file: str | None, store_key: bytes | None) -> str:
    got = push(store, url, sign_key=fleet_key(key_file), store_key=store_key, progress=_bar("push"))
    if not got.uploaded:
        return f"{url} already holds every epoch of {store} ({got.already} there)"
    return (f"pushed {len(got.uploaded)} epoch(s) ({got.uploaded[0]}..{got.uploaded[-1]}) of {store} to {url}: "
            f"{got.sent_bytes / 2**20:.2f} MiB sent in {got.seconds:.2f} s")


def _bar(verb: str) -> Callable[[str, int, int], None] | None:
    """A progress line on a terminal (a transfer of more than a second or two); silent otherwise."""
    if not sys.stderr.isatty():
        return None

    def show(what: str, done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{verb}: {what} {done}/{total}", end=end, file=sys.stderr, flush=True)
    return show
