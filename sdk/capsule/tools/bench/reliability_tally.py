"""Tallies of the reliability campaign's trials: counts, failures grouped by cause (cause_of) with
one recipe each (describe: the JSON a failing trial is rerun from). Torch-free.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


def describe(**kw: Any) -> str:
    return json.dumps(kw, sort_keys=True, default=str)


@dataclass
class Tally:
    """Counts and failures of one family of trials. failures: (cause, recipe) pairs."""
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def fail(self, cause: str, recipe: str) -> None:
        self.failures.append((cause, recipe))

    def merge(self, other: "Tally") -> "Tally":
        for k, v in other.counts.items():
            self.add(k, v)
        self.failures += other.failures
        return self

    def report(self, limit: int = 12) -> str:
        """Failures grouped by cause, one recipe each (plus the count)."""
        groups: dict[str, list[str]] = {}
        for cause, recipe in self.failures:
            groups.setdefault(cause, []).append(recipe)
        lines = [f"{len(self.failures)} failing trials in {len(groups)} causes; counts {self.counts}"]
        for cause, recipes in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]:
            lines.append(f"- [{len(recipes)}x] {cause}\n    recipe: {recipes[0]}")
        return "\n".join(lines)


def cause_of(problem: str) -> str:
    """A problem message reduced to its cause, for grouping: paths and numbers dropped, and an
    exception cut to its type."""
    text = re.sub(r"/\S+", "PATH", problem)
    m = re.search(r" raised (untyped )?(\w+)", text)
    if m:
        text = text[:m.end()]
    text = re.sub(r"\d+", "N", text)
    for cut in (" (report:", " (no report)", " (got ", "; skipped", " (store holds", ": ["):
        if cut in text:
            text = text[:text.index(cut)] + (" with no report" if cut == " (no report)" else
                                             " with a report" if cut == " (report:" else "")
    return text[:150]
