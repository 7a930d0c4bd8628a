"""`capsule repair STORE`: rebuild a store's index from its segment log, with progress and a report."""
from __future__ import annotations

import os

from tqdm import tqdm

from ..memory.facttable import FactTable
from .store_report import open_existing


def repair_store(path: str | os.PathLike, sign_key: bytes | None = None, source: str = "") -> str:
    """Rebuild path's index.sqlite from its segments (the old index goes to quarantine/); returns
    the report: what opening already recovered, what the rebuild did, what the store now holds."""
    with open_existing(path, sign_key, source) as store:
        lines = list(store.recovery_report)
        if not any(line.startswith("index rebuilt") for line in lines):   # opening did not rebuild it already
            with tqdm(desc="scanning segments", unit="file", leave=False, disable=None) as bar:
                def progress(done: int, total: int) -> None:
                    bar.total = total
                    bar.update(done - bar.n)
                lines += store.repair("asked for (capsule repair)", progress=progress)
        epochs, facts = store.epochs(), FactTable(store).count_facts()
        report = store.verify()
    held = (f"store {path}: {len(epochs)} epoch(s)"
            + (f" ({epochs[0].id}..{epochs[-1].id})" if len(epochs) > 1 else "") + f", {facts} fact(s); verify: "
            + ("ok" if report.ok else f"{len(report.problems)} problems (run `capsule verify`)"))
    return "\n".join([*lines, held])
